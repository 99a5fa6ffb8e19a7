"""``kvmetrics run``: one lab run, its summary, and optionally a JSON file and an HTML report."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from kvmetrics.cli.common import (
    EXIT_OUTPUT,
    Command,
    check_output_path,
    clashing_paths,
    fail,
    say,
    stderr_is_tty,
    stdout_is_tty,
    write_output,
)
from kvmetrics.metrics import strict_json

if TYPE_CHECKING:
    from kvmetrics.lab.config import LabConfig
    from kvmetrics.lab.runner import LabResult, Narrator

#: Used when ``--verify sampled`` is given without ``--verify-fraction``.
DEFAULT_VERIFY_FRACTION = 0.25
#: Exit codes of ``kvmetrics run`` (2, bad input, is every command's; docs/lab.md lists all).
EXIT_STRICT = 1
EXIT_STALE_READS = 3


def _add(p: argparse.ArgumentParser) -> None:
    from kvmetrics.lab.config import DEVICES, VERIFY_MODES
    from kvmetrics.lab.engine.config import ACCOUNTINGS, POLICIES, RECOVERIES
    from kvmetrics.lab.engine.connector import LOAD_MODES
    from kvmetrics.lab.engine_registry import engine_names
    from kvmetrics.lab.synthetic import DESCRIPTIONS
    from kvmetrics.lab.traces import FORMATS

    g = p.add_argument_group("workload")
    g.add_argument("--engine", default="reference", choices=engine_names(),
                   help="engine to drive (default reference; vllm needs vLLM installed)")
    g.add_argument("--workload", default="mixed", choices=tuple(DESCRIPTIONS),
                   help="synthetic workload (see `kvmetrics workloads`); default mixed")
    g.add_argument("--trace", metavar="PATH", help="replay a trace file instead")
    g.add_argument("--trace-format", default="kvmetrics", choices=FORMATS,
                   help="format of --trace (default kvmetrics)")
    g.add_argument("--max-requests", type=int, metavar="N",
                   help="requests to generate (synthetic, default 300) or replay (trace)")
    g.add_argument("--max-tokens", type=int, metavar="N",
                   help="override every request's output length")
    g.add_argument("--step-seconds", type=float, default=0.02, metavar="S",
                   help="workload seconds per engine step (maps arrival times to steps; "
                   "default 0.02)")
    g.add_argument("--realtime", action="store_true",
                   help="pace steps to --step-seconds of wall time (live dashboards, demos)")
    g.add_argument("--abort-rate", type=float, default=0.0, metavar="P",
                   help="probability that a request is aborted after it arrives "
                   "(default 0)")
    g.add_argument("--abort-within-steps", type=int, default=40, metavar="N",
                   help="an aborted request goes 1..N steps after it arrives (small N: "
                   "right after admission, when a load it made may just have failed)")
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16, metavar="N",
                   help="tokens per KV block")
    g.add_argument("--num-gpu-blocks", type=int, default=512, metavar="N",
                   help="KV blocks on the device (block 0 is reserved, as in vLLM)")
    g.add_argument("--max-num-seqs", type=int, default=32, metavar="N",
                   help="requests running at once (vLLM's option)")
    g.add_argument("--max-num-batched-tokens", type=int, default=1024, metavar="N",
                   help="tokens scheduled per step (vLLM's option)")
    g.add_argument("--store-blocks", type=int, metavar="N",
                   help="external store capacity in blocks (default 4x GPU blocks; 0: none)")
    g.add_argument("--policy", default="recompute", choices=POLICIES,
                   help="KV load failure policy: recompute (the lab's default) or fail. "
                   "vLLM's own default is fail (since #34896); the lab recomputes by "
                   "default because that is the path whose rollbacks, recomputes and "
                   "stale reads it exists to measure")
    g.add_argument("--accounting", default="unified", choices=ACCOUNTINGS,
                   help="unified (default) or historical (reproduces the old negative counts)")
    g.add_argument("--recovery", default="vllm", choices=RECOVERIES,
                   help="vllm (default): vLLM 0.33's recovery path, its defects included "
                   "(the reference engine reproduces them); evict: the complete fix, on "
                   "either engine (on vLLM its scheduler's opt-in KVMETRICS_RECOVERY=evict). "
                   "See docs/vllm-defects.md")
    g.add_argument("--async-scheduling", action="store_true",
                   help="vLLM's async scheduling: a batch queue of two steps, step n+1 "
                   "scheduled before step n's output is processed. vLLM's default on "
                   "GPUs; the lab's default is lockstep, what vLLM runs on CPUs and with "
                   "a synchronous --scheduler-cls")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="at most N tokens per request and step while others wait "
                   "(vLLM's option; 0, its default, is off)")
    g.add_argument("--no-reserve-full-prompt", dest="reserve_full_prompt",
                   action="store_false",
                   help="admit a request when its first chunk fits (vLLM's "
                   "scheduler_reserve_full_isl off; on by default, as in vLLM)")
    g = p.add_argument_group("faults")
    g.add_argument("--fault-rate", type=float, default=0.02, metavar="P",
                   help="probability that each loaded block fails (default 0.02)")
    g.add_argument("--fault-mode", default="mixed", choices=LOAD_MODES,
                   help="load mode of external hits (default mixed)")
    g.add_argument("--fault-plan", metavar="FILE",
                   help='JSON fault plan: {"rate": P, "seed": N, "failures": '
                   '[{"block": I, "request": ID, "step": S}]}')
    g = p.add_argument_group("data plane")
    g.add_argument("--kv-dim", type=int, default=8, metavar="N",
                   help="width of each token's KV vector in the data plane")
    g.add_argument("--device", default="auto", choices=DEVICES,
                   help="where the data plane's KV tensors live (auto: cuda if present)")
    g.add_argument("--verify", default="full", choices=VERIFY_MODES,
                   help="full (default), sampled or off; off runs the tensor-less executor "
                   "(same schedule, no KV tensors), so --device and --kv-dim do not apply")
    g.add_argument("--verify-fraction", type=float, metavar="P",
                   help="share of requests verified per step with --verify sampled "
                   f"(default {DEFAULT_VERIFY_FRACTION})")
    g.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seeds the workload, the faults and the aborts")
    g = p.add_argument_group("output")
    g.add_argument("--serve", metavar="HOST:PORT",
                   help="serve Prometheus metrics while running (e.g. 127.0.0.1:9400)")
    g.add_argument("--linger", type=float, metavar="S",
                   help="with --serve: keep serving metrics this many seconds after the run")
    g.add_argument("--wait-for-scrape", type=float, default=0.0, metavar="S",
                   help="with --serve: start the run only after the endpoint was scraped "
                   "once (at most S seconds), so Prometheus sees every series from 0")
    g.add_argument("--serve-tls-cert", metavar="FILE",
                   help="with --serve: serve HTTPS with this PEM certificate (needs the key)")
    g.add_argument("--serve-tls-key", metavar="FILE", help="the certificate's PEM private key")
    g.add_argument("--serve-tls-client-ca", metavar="FILE",
                   help="require client certificates signed by this CA (mutual TLS)")
    g.add_argument("--otlp-endpoint", metavar="URL",
                   help="push metrics over OTLP/HTTP (e.g. http://127.0.0.1:4318)")
    g.add_argument("--model-name", default="kvmetrics-lab", help="model_name label value")
    g.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    g.add_argument("--output", metavar="PATH",
                   help="also write the run as JSON to PATH: the summary, the configuration "
                   "and the per-step timeline (`kvmetrics report PATH` charts it)")
    g.add_argument("--report", metavar="FILE.html",
                   help="also write a self-contained HTML report with charts over the steps")
    g.add_argument("--strict", action="store_true",
                   help="stop at the first guard rejection, invariant violation or stale KV "
                   f"read and exit {EXIT_STRICT}")
    g.add_argument("--allow-stale-reads", action="store_true",
                   help=f"exit 0 even when the verifier found stale KV reads (otherwise "
                   f"such a run exits {EXIT_STALE_READS})")
    g.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")


def _misplaced(args: argparse.Namespace) -> str | None:
    """Options given where they cannot apply (a silent no-op would mislead)."""
    if args.linger is not None and not args.serve:
        return "--linger needs --serve (there is no metrics endpoint to keep open)"
    if args.verify_fraction is not None and args.verify != "sampled":
        return f"--verify-fraction needs --verify sampled (got --verify {args.verify})"
    for option in ("output", "report"):
        problem = check_output_path(getattr(args, option))
        if problem:
            return f"--{option}: {problem}"
    clash = clashing_paths({"--output": args.output, "--report": args.report},
                           {"--trace": args.trace, "--fault-plan": args.fault_plan})
    if clash:
        return clash
    return _cheap_checks(args)


def _cheap_checks(args: argparse.Namespace) -> str | None:
    """What can be refused in milliseconds, before torch or an engine is imported."""
    if args.serve:
        from kvmetrics.lab.runner import parse_host_port  # re-exported: cli sits above lab

        try:
            host, port = parse_host_port(args.serve)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except (ValueError, OSError) as e:
            return f"cannot serve metrics on {args.serve}: {getattr(e, 'strerror', None) or e}"
    if args.device == "cuda" and args.verify != "off" and not _nvidia_present():
        return "--device cuda: no CUDA device is available (no NVIDIA driver found)"
    return None


def _nvidia_present() -> bool:
    """Whether an NVIDIA driver is loaded (torch is imported later to be sure)."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


def config_from_args(args: argparse.Namespace) -> LabConfig:
    """The run's configuration from its parsed options (the inverse of
    :func:`kvmetrics.lab.replay.run_arguments`)."""
    from kvmetrics.lab.config import LabConfig

    return LabConfig(
        engine=args.engine, workload=args.workload, trace=args.trace,
        trace_format=args.trace_format, max_requests=args.max_requests,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_tokens=args.max_tokens, fault_rate=args.fault_rate, fault_mode=args.fault_mode,
        fault_plan=args.fault_plan, policy=args.policy, accounting=args.accounting,
        recovery=args.recovery, async_scheduling=args.async_scheduling,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        reserve_full_prompt=args.reserve_full_prompt,
        store_blocks=args.store_blocks, kv_dim=args.kv_dim,
        device=args.device, verify=args.verify,
        verify_fraction=(DEFAULT_VERIFY_FRACTION if args.verify_fraction is None
                         else args.verify_fraction),
        seed=args.seed, step_seconds=args.step_seconds, realtime=args.realtime,
        abort_rate=args.abort_rate,
        abort_within_steps=args.abort_within_steps, serve=args.serve, linger=args.linger or 0.0,
        wait_for_scrape=args.wait_for_scrape,
        otlp_endpoint=args.otlp_endpoint, strict=args.strict, model_name=args.model_name,
        serve_tls_cert=args.serve_tls_cert, serve_tls_key=args.serve_tls_key,
        serve_tls_client_ca=args.serve_tls_client_ca,
        progress=not args.no_progress and stderr_is_tty())


def _run(args: argparse.Namespace) -> int:
    from kvmetrics.lab.config import LabError
    from kvmetrics.lab.engine.faults import FaultPlanError
    from kvmetrics.lab.kv_errors import is_verification_error
    from kvmetrics.lab.report import ReportUnavailable, require_report_support
    from kvmetrics.lab.runner import EngineStalled, run_lab
    from kvmetrics.lab.traces import TraceError
    from kvmetrics.metrics.guard import CounterViolationError

    problem = _misplaced(args)
    if problem:
        return fail(problem)
    if args.report:
        try:
            require_report_support()
        except ReportUnavailable as e:
            return fail(str(e))
    cfg = config_from_args(args)
    finished: list[LabResult] = []
    written: list[bool] = []

    def on_finished(result: LabResult) -> None:
        """The summary, then the outputs, before any linger, so that a signal then
        loses nothing and a failed write (a full disk) loses no summary."""
        finished.append(result)
        _print_summary(result, args)
        written.append(_write_outputs(result, args))

    try:
        run_lab(cfg, on_finished=on_finished, narrator=_narrator())
    except (LabError, TraceError, FaultPlanError) as e:
        return fail(str(e))
    except (CounterViolationError, EngineStalled) as e:
        prefix = "strict mode: " if isinstance(e, CounterViolationError) else ""
        say(f"{prefix}{e}")
        return EXIT_OUTPUT if False in written else EXIT_STRICT
    except Exception as e:
        if is_verification_error(e):
            say(f"strict mode: {e}")
            return EXIT_OUTPUT if False in written else EXIT_STRICT
        raise
    if False in written:
        return EXIT_OUTPUT
    return exit_code(finished[0].summary, args)


def _write_outputs(result: LabResult, args: argparse.Namespace) -> bool:
    """Write --output and --report; False (each failure said in one line) if one failed."""
    from kvmetrics.lab.report import render_report

    document = result.document()
    ok = True
    if args.output:
        if write_output(args.output, strict_json.dumps(document, indent=2, sort_keys=True)
                        + "\n"):
            say(f"run written to {args.output}")
        else:
            ok = False
    if args.report:
        if write_output(args.report, render_report(document)):
            say(f"report written to {args.report}")
        else:
            ok = False
    return ok


def _print_summary(result: LabResult, args: argparse.Namespace) -> None:
    """Print the summary; a stdout that is gone (a hung-up terminal, a closed pipe)
    must not stop the outputs from being written after it."""
    from kvmetrics.lab.summary import render_table

    with suppress(OSError):
        if args.json:
            print(strict_json.dumps({k: v for k, v in result.document().items()
                                     if k != "timeline"}, indent=2, sort_keys=True), flush=True)
        else:
            print(render_table(result.document(), rich=stdout_is_tty()), flush=True)
    if result.interrupted:
        say(f"interrupted at step {result.summary['steps']}: the summary covers the steps "
            "run so far")


def _narrator() -> Narrator:
    from kvmetrics.lab.runner import Narrator

    class StderrNarrator(Narrator):
        def say(self, message: str) -> None:
            say(message)

        def linger(self, seconds: float) -> None:
            if not stderr_is_tty():
                say(f"lingering {seconds:g} s, still serving metrics (Ctrl-C stops)")
                time.sleep(seconds)
                return
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                print(f"\rkvmetrics: lingering, still serving metrics: {left:4.0f} s left "
                      "(Ctrl-C stops) ", end="", file=sys.stderr, flush=True)
                time.sleep(min(1.0, left))
            print(file=sys.stderr)

    return StderrNarrator()


def exit_code(summary: dict[str, Any], args: argparse.Namespace) -> int:
    if args.strict and (summary["guard_rejected_increments"] or summary["invariant_violations"]):
        print("kvmetrics: strict mode: guard rejections or invariant violations",
              file=sys.stderr)
        return EXIT_STRICT
    stale = summary["verification"]["failed_blocks"]
    if stale and not args.allow_stale_reads:
        print(f"kvmetrics: the verifier found {stale} stale KV block read(s); exit "
              f"{EXIT_STALE_READS} (--allow-stale-reads exits 0)", file=sys.stderr)
        return EXIT_STALE_READS
    return 0


COMMAND = Command(
    "run", "replay a workload with injected KV-load faults", _add, _run,
    description="Drive an engine with a workload and a fault plan, verify every KV read, "
    "serve metrics, and print a summary.",
    examples=(
        "kvmetrics run                                  # mixed workload, 2% failed loads",
        "kvmetrics run --report run.html                # + an HTML report with charts",
        "kvmetrics run --policy fail --fault-rate 0.1 --json",
        "kvmetrics run --engine vllm --max-requests 100  # vLLM's real scheduler",
        "kvmetrics run --engine vllm --async-scheduling  # vLLM's default on GPUs",
        "kvmetrics run --engine vllm --recovery evict    # with the complete fix",
        "kvmetrics run --serve 127.0.0.1:9400 --linger 60 --realtime",
    ))
