"""Everything a lab run is configured by, validated up front with one-line errors."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from kvmetrics.lab.engine.config import ACCOUNTINGS, POLICIES, RECOVERIES
from kvmetrics.lab.engine.connector import LOAD_MODES
from kvmetrics.lab.synthetic import DESCRIPTIONS
from kvmetrics.lab.traces import FORMATS
from kvmetrics.metrics.labels import check_label_value

VERIFY_MODES = ("full", "sampled", "off")
DEVICES = ("auto", "cpu", "cuda")


#: Upper bounds far above any real engine (a GPU holds ~10^5 blocks), so an absurd
#: number is one line here instead of a MemoryError or an overflow deep in a run.
LIMITS = {"block_size": 1 << 16, "num_gpu_blocks": 10_000_000, "max_num_seqs": 1 << 20,
          "max_num_batched_tokens": 1 << 24, "kv_dim": 1 << 14, "abort_within_steps": 1 << 30,
          "max_requests": 10_000_000, "max_tokens": 10_000_000}
#: The data plane keeps GPU and store blocks as float32 tensors; refuse a run whose KV
#: alone would take more than this share of the machine's memory.
KV_MEMORY_SHARE = 0.5
MIN_STEP_SECONDS = 1e-6


#: What a lab command says when vLLM is missing: a command that installs it and the doc
#: section that explains the install (tests/test_readme.py checks the section exists).
VLLM_INSTALL_HINT = ("install the light CPU-only vLLM with: bash scripts/install.sh --vllm "
                     "(docs/user-guide.md#installing)")


class LabError(ValueError):
    """Bad input to a lab run; the message is shown to the user as one line."""


@dataclass
class LabConfig:
    engine: str = "reference"
    workload: str = "mixed"
    trace: str | None = None
    trace_format: str = "kvmetrics"
    #: Synthetic: how many requests to generate. Trace: replay at most this many.
    max_requests: int | None = None
    block_size: int = 16
    num_gpu_blocks: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    #: Overrides every request's output length.
    max_tokens: int | None = None
    fault_rate: float = 0.02
    fault_mode: str = "mixed"
    fault_plan: str | None = None
    policy: str = "recompute"
    accounting: str = "unified"
    #: ``vllm``: vLLM 0.33's recovery path, its defects included (the reference engine
    #: reproduces them). ``evict``: the complete fix on either engine (on vLLM, its
    #: scheduler's opt-in protective mode). See docs/vllm-defects.md.
    recovery: str = "vllm"
    #: vLLM's async scheduling (its default on GPUs): a batch queue of two steps.
    async_scheduling: bool = False
    #: vLLM's ``long_prefill_token_threshold`` (0: off, vLLM's default).
    long_prefill_token_threshold: int = 0
    #: vLLM's ``scheduler_reserve_full_isl`` (on, as in vLLM).
    reserve_full_prompt: bool = True
    #: Capacity of the external (host) store in blocks; 0 runs without a connector.
    store_blocks: int | None = None
    kv_dim: int = 8
    device: str = "auto"
    verify: str = "full"
    verify_fraction: float = 0.25
    seed: int = 0
    #: Workload seconds per engine step: a request arriving at t seconds joins the
    #: scheduler before step floor(t / step_seconds) (idle stretches are skipped).
    step_seconds: float = 0.02
    #: Pace the run so each step takes at least ``step_seconds`` of wall time, so a
    #: scraper sees the counters move as they would in production (demos, tests).
    realtime: bool = False
    #: Probability that a request is aborted some steps after it arrives.
    abort_rate: float = 0.0
    #: An aborted request goes 1..N steps after its arrival (small N: right after
    #: its admission, when a load it made may just have failed).
    abort_within_steps: int = 40
    serve: str | None = None
    linger: float = 0.0
    #: With ``serve``: start the run only once the endpoint has been scraped (waiting at
    #: most this many seconds), so a Prometheus sees every series at 0 before the first
    #: event and ``increase()`` over the run is exact.
    wait_for_scrape: float = 0.0
    otlp_endpoint: str | None = None
    strict: bool = False
    model_name: str = "kvmetrics-lab"
    progress: bool = True
    #: TLS for the ``serve`` endpoint: certificate and key (PEM), and a CA whose client
    #: certificates are then required (mutual TLS).
    serve_tls_cert: str | None = None
    serve_tls_key: str | None = None
    serve_tls_client_ca: str | None = None

    DEFAULT_SYNTHETIC_REQUESTS = 300

    def validate(self) -> None:
        # The engine name is checked where engines are looked up (kvmetrics.lab.engine_registry).
        if self.trace is None:
            _choice("workload", self.workload, tuple(DESCRIPTIONS))
        _choice("trace format", self.trace_format, FORMATS)
        _choice("fault mode", self.fault_mode, LOAD_MODES)
        _choice("policy", self.policy, POLICIES)
        _choice("accounting", self.accounting, ACCOUNTINGS)
        _choice("recovery", self.recovery, RECOVERIES)
        _choice("verify mode", self.verify, VERIFY_MODES)
        _choice("device", self.device, DEVICES)
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "kv_dim", "abort_within_steps"):
            _positive(name, getattr(self, name))
        if self.num_gpu_blocks < 2:
            raise LabError("--num-gpu-blocks must be at least 2 (block 0 is reserved)")
        for name in ("max_requests", "max_tokens"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        for name, limit in LIMITS.items():
            value = getattr(self, name)
            if value is not None and value > limit:
                raise LabError(f"--{name.replace('_', '-')} must be at most {limit:,}, "
                               f"got {value:,}")
        if isinstance(self.long_prefill_token_threshold, bool) \
                or not isinstance(self.long_prefill_token_threshold, int) \
                or self.long_prefill_token_threshold < 0:
            raise LabError("--long-prefill-token-threshold must be an integer >= 0, "
                           f"got {self.long_prefill_token_threshold!r}")
        if self.store_blocks is not None and (isinstance(self.store_blocks, bool)
                                              or not 0 <= self.store_blocks
                                              <= 4 * LIMITS["num_gpu_blocks"]):
            raise LabError(f"--store-blocks must be within 0..{4 * LIMITS['num_gpu_blocks']:,}"
                           f", got {self.store_blocks:,}")
        if self.long_prefill_token_threshold > LIMITS["max_num_batched_tokens"]:
            raise LabError("--long-prefill-token-threshold must be at most "
                           f"{LIMITS['max_num_batched_tokens']:,}")
        _fraction("fault rate", self.fault_rate)
        _fraction("verify fraction", self.verify_fraction)
        _fraction("abort rate", self.abort_rate)
        if not (math.isfinite(self.step_seconds) and self.step_seconds >= MIN_STEP_SECONDS):
            raise LabError(f"--step-seconds must be at least {MIN_STEP_SECONDS:g}, got "
                           f"{self.step_seconds:g}")
        self._check_kv_memory()
        if not (math.isfinite(self.linger) and self.linger >= 0):
            raise LabError(f"--linger must be >= 0 seconds, got {self.linger}")
        if not (math.isfinite(self.wait_for_scrape) and self.wait_for_scrape >= 0):
            raise LabError(f"--wait-for-scrape must be >= 0 seconds, got {self.wait_for_scrape}")
        if self.wait_for_scrape and not self.serve:
            raise LabError("--wait-for-scrape needs --serve (nothing can scrape the run)")
        try:
            check_label_value("--model-name", self.model_name)
        except ValueError as e:
            raise LabError(str(e)) from None
        if (self.serve_tls_cert or self.serve_tls_key or self.serve_tls_client_ca) \
                and not self.serve:
            raise LabError("--serve-tls-* need --serve (there is no endpoint to secure)")

    def _check_kv_memory(self) -> None:
        if self.verify == "off":
            return  # the tensor-less executor holds no KV
        need = (self.num_gpu_blocks + self.store_capacity) * self.block_size * self.kv_dim * 4
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
        if need > KV_MEMORY_SHARE * have:
            raise LabError(f"the data plane's KV would take {need / 2**30:.1f} GiB, more "
                           f"than {KV_MEMORY_SHARE:.0%} of this machine's "
                           f"{have / 2**30:.1f} GiB: lower --num-gpu-blocks, --store-blocks, "
                           "--block-size or --kv-dim, or run with --verify off")

    @property
    def store_capacity(self) -> int:
        return 4 * self.num_gpu_blocks if self.store_blocks is None else self.store_blocks


def _choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise LabError(f"unknown {what} {value!r} (choose from {', '.join(allowed)})")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LabError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def _fraction(what: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise LabError(f"{what} must be within 0..1, got {value!r}")
