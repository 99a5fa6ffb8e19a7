"""A lab configuration as the ``kvmetrics run`` command line that reproduces it.

A soak scenario is a :class:`~kvmetrics.lab.config.LabConfig` drawn from a seed;
to study one, a person wants the exact ``kvmetrics run`` line, not a Python
function to translate by hand. :data:`RUN_OPTIONS` maps each setting that shapes
a run to its option; only settings that differ from the defaults are written, and
``tests/test_lab_replay.py`` checks both that the CLI's defaults equal
:class:`LabConfig`'s and that the printed line replays a scenario exactly.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from kvmetrics.lab.config import LabConfig


@dataclass(frozen=True)
class RunOption:
    field: str
    flag: str
    #: ``value``: ``--flag VALUE``; ``on``: a switch that sets True; ``off``: sets False.
    kind: str = "value"
    #: The argument group of ``kvmetrics run --help`` it is listed under (the report
    #: groups the configuration the same way; a test checks they agree).
    group: str = "workload"

    def shown(self, value: object) -> object:
        """The setting as its flag has it: a value, or whether the switch was given (the
        field behind ``--no-reserve-full-prompt`` is True when the flag was not)."""
        if self.kind == "value":
            return value
        given = bool(value) if self.kind == "on" else not value
        return "given" if given else "not given"


RUN_OPTIONS: tuple[RunOption, ...] = (
    RunOption("engine", "--engine"),
    RunOption("workload", "--workload"),
    RunOption("trace", "--trace"),
    RunOption("trace_format", "--trace-format"),
    RunOption("max_requests", "--max-requests"),
    RunOption("max_tokens", "--max-tokens"),
    RunOption("step_seconds", "--step-seconds"),
    RunOption("abort_rate", "--abort-rate"),
    RunOption("abort_within_steps", "--abort-within-steps"),
    RunOption("block_size", "--block-size", group="engine"),
    RunOption("num_gpu_blocks", "--num-gpu-blocks", group="engine"),
    RunOption("max_num_seqs", "--max-num-seqs", group="engine"),
    RunOption("max_num_batched_tokens", "--max-num-batched-tokens", group="engine"),
    RunOption("store_blocks", "--store-blocks", group="engine"),
    RunOption("policy", "--policy", group="engine"),
    RunOption("accounting", "--accounting", group="engine"),
    RunOption("recovery", "--recovery", group="engine"),
    RunOption("async_scheduling", "--async-scheduling", "on", group="engine"),
    RunOption("long_prefill_token_threshold", "--long-prefill-token-threshold", group="engine"),
    RunOption("reserve_full_prompt", "--no-reserve-full-prompt", "off", group="engine"),
    RunOption("fault_rate", "--fault-rate", group="faults"),
    RunOption("fault_mode", "--fault-mode", group="faults"),
    RunOption("fault_plan", "--fault-plan", group="faults"),
    RunOption("kv_dim", "--kv-dim", group="data plane"),
    RunOption("device", "--device", group="data plane"),
    RunOption("verify", "--verify", group="data plane"),
    RunOption("verify_fraction", "--verify-fraction", group="data plane"),
    RunOption("seed", "--seed", group="data plane"),
)

#: Settings about watching a run, not its outcome; never part of a replay line.
NOT_REPLAYED = frozenset({"serve", "linger", "wait_for_scrape", "otlp_endpoint", "strict",
                          "model_name", "progress", "realtime", "serve_tls_cert",
                          "serve_tls_key", "serve_tls_client_ca"})


def run_arguments(cfg: LabConfig) -> list[str]:
    """The ``kvmetrics run`` arguments that rebuild ``cfg`` (its non-default settings)."""
    default = LabConfig()
    args: list[str] = []
    for option in RUN_OPTIONS:
        value = getattr(cfg, option.field)
        if value == getattr(default, option.field):
            continue
        if option.field == "verify_fraction" and cfg.verify != "sampled":
            continue  # only meaningful (and only accepted) with --verify sampled
        if option.kind == "value":
            args += [option.flag, _text(value)]
        elif bool(value) == (option.kind == "on"):
            args.append(option.flag)
    return args


def run_command(cfg: LabConfig) -> str:
    """The whole line, quoted for a POSIX shell."""
    return shlex.join(["kvmetrics", "run", *run_arguments(cfg)])


def _text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)
