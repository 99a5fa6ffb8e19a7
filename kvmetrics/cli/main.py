"""The ``kvmetrics`` command: a thin layer over the lab that turns bad input into one line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from kvmetrics import __version__

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as a single line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"kvmetrics: error: {message}\n")


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="replay a workload with injected KV-load faults",
                       description="Drive an engine with a workload and a fault plan, verify "
                       "every KV read, serve metrics, and print a summary.")
    g = p.add_argument_group("workload")
    g.add_argument("--engine", default="reference", help="reference (default) or vllm")
    g.add_argument("--workload", default="mixed",
                   help="synthetic workload (see `kvmetrics workloads`); default mixed")
    g.add_argument("--trace", metavar="PATH", help="replay a trace file instead")
    g.add_argument("--trace-format", default="kvmetrics", help="kvmetrics (default) or mooncake")
    g.add_argument("--max-requests", type=int, metavar="N",
                   help="requests to generate (synthetic, default 300) or replay (trace)")
    g.add_argument("--max-tokens", type=int, metavar="N",
                   help="override every request's output length")
    g.add_argument("--step-seconds", type=float, default=0.02, metavar="S",
                   help="workload seconds per engine step (maps arrival times to steps)")
    g.add_argument("--realtime", action="store_true",
                   help="pace steps to --step-seconds of wall time (live dashboards, demos)")
    g.add_argument("--abort-rate", type=float, default=0.0, metavar="P",
                   help="probability that a request is aborted after it arrives")
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-gpu-blocks", type=int, default=512)
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--store-blocks", type=int, metavar="N",
                   help="external store capacity in blocks (default 4x GPU blocks; 0: none)")
    g.add_argument("--policy", default="recompute", help="KV load failure policy: "
                   "recompute (default) or fail")
    g.add_argument("--accounting", default="unified",
                   help="unified (default) or historical (reproduces the old negative counts)")
    g.add_argument("--recovery", default="vllm",
                   help="vllm (default: vLLM 0.33's recovery path) or evict (the fix for its "
                   "stale reads; reference engine only)")
    g = p.add_argument_group("faults")
    g.add_argument("--fault-rate", type=float, default=0.02, metavar="P",
                   help="probability that each loaded block fails (default 0.02)")
    g.add_argument("--fault-mode", default="mixed", help="sync, async or mixed loads")
    g.add_argument("--fault-plan", metavar="FILE",
                   help='JSON fault plan: {"rate": P, "seed": N, "failures": '
                   '[{"block": I, "request": ID, "step": S}]}')
    g = p.add_argument_group("data plane")
    g.add_argument("--kv-dim", type=int, default=8)
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--verify", default="full",
                   help="full (default), sampled or off; off runs the tensor-less executor "
                   "(same schedule, no KV tensors), so --device and --kv-dim do not apply")
    g.add_argument("--verify-fraction", type=float, default=0.25, metavar="P",
                   help="share of requests verified per step with --verify sampled")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--serve", metavar="HOST:PORT",
                   help="serve Prometheus metrics while running (e.g. 127.0.0.1:9400)")
    g.add_argument("--linger", type=float, default=0.0, metavar="S",
                   help="keep serving metrics this many seconds after the run")
    g.add_argument("--wait-for-scrape", type=float, default=0.0, metavar="S",
                   help="with --serve: start the run only after the endpoint was scraped "
                   "once (at most S seconds), so Prometheus sees every series from 0")
    g.add_argument("--otlp-endpoint", metavar="URL",
                   help="push metrics over OTLP/HTTP (e.g. http://127.0.0.1:4318)")
    g.add_argument("--model-name", default="kvmetrics-lab", help="model_name label value")
    g.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    g.add_argument("--output", metavar="PATH", help="also write the JSON summary to PATH")
    g.add_argument("--strict", action="store_true",
                   help="fail on any counter violation or verification failure")
    g.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    g.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvmetrics", description="Observability and a lab for KV-cache "
                     "load failures and recovery in vLLM-style engines.")
    parser.add_argument("--version", action="version", version=f"kvmetrics {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_run(sub)
    p = sub.add_parser("soak", help="run many seeded random scenarios and count violations")
    p.add_argument("--scenarios", type=int, default=100, metavar="N")
    p.add_argument("--engines", default="reference",
                   help="comma-separated engines to run each scenario on (reference,vllm)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first scenario")
    p.add_argument("--accounting", default="unified", help="unified (default) or historical")
    p.add_argument("--verify", default="full", help="full (default), sampled or off")
    p.add_argument("--recovery", default="vllm", help="vllm (default) or evict")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.add_parser("workloads", help="list the synthetic workloads")
    sub.add_parser("catalogue", help="list every exported metric")
    return parser


def _write_atomically(path: str, text: str) -> None:
    """Write via a temp file and rename, so a failed run never truncates an old result."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cmd_run(args: argparse.Namespace) -> int:
    from kvmetrics.engine.faults import FaultPlanError
    from kvmetrics.kv_errors import is_verification_error
    from kvmetrics.lab.config import LabConfig, LabError
    from kvmetrics.lab.runner import EngineStalled, run_lab
    from kvmetrics.lab.summary import render_table
    from kvmetrics.lab.traces import TraceError
    from kvmetrics.metrics.guard import CounterViolationError

    if args.output and not Path(args.output).parent.exists():
        return _fail(f"output directory {Path(args.output).parent} does not exist")
    if args.output and Path(args.output).is_dir():
        return _fail(f"--output {args.output} is a directory, not a file")
    cfg = LabConfig(
        engine=args.engine, workload=args.workload, trace=args.trace,
        trace_format=args.trace_format, max_requests=args.max_requests,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_tokens=args.max_tokens, fault_rate=args.fault_rate, fault_mode=args.fault_mode,
        fault_plan=args.fault_plan, policy=args.policy, accounting=args.accounting,
        recovery=args.recovery,
        store_blocks=args.store_blocks, kv_dim=args.kv_dim, device=args.device,
        verify=args.verify, verify_fraction=args.verify_fraction, seed=args.seed,
        step_seconds=args.step_seconds, realtime=args.realtime, abort_rate=args.abort_rate,
        serve=args.serve,
        linger=args.linger, wait_for_scrape=args.wait_for_scrape,
        otlp_endpoint=args.otlp_endpoint, strict=args.strict,
        model_name=args.model_name,
        progress=not args.no_progress and sys.stderr.isatty())
    try:
        result = run_lab(cfg)
    except (LabError, TraceError, FaultPlanError) as e:
        return _fail(str(e))
    except CounterViolationError as e:
        print(f"kvmetrics: strict mode: {e}", file=sys.stderr)
        return 1
    except EngineStalled as e:
        print(f"kvmetrics: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if is_verification_error(e):
            print(f"kvmetrics: strict mode: {e}", file=sys.stderr)
            return 1
        raise
    summary = result.summary
    text = json.dumps(summary, indent=2, sort_keys=True)
    if args.output:
        _write_atomically(args.output, text + "\n")
    print(text if args.json else render_table(summary))
    if args.strict and (summary["guard_rejected_increments"] or summary["invariant_violations"]
                        or summary["verification"]["failed_blocks"]):
        print("kvmetrics: strict mode: violations or verification failures", file=sys.stderr)
        return 1
    return 0


def _cmd_soak(args: argparse.Namespace) -> int:
    from kvmetrics.engine.config import ACCOUNTINGS, RECOVERIES
    from kvmetrics.lab.config import ENGINES, VERIFY_MODES
    from kvmetrics.lab.progress import Progress
    from kvmetrics.lab.soak import soak

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for engine in engines:
        if engine not in ENGINES:
            return _fail(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    if args.verify not in VERIFY_MODES:
        return _fail(f"unknown verify mode {args.verify!r}")
    if args.accounting not in ACCOUNTINGS:
        return _fail(f"unknown accounting {args.accounting!r}")
    if args.recovery not in RECOVERIES:
        return _fail(f"unknown recovery {args.recovery!r}")
    if args.scenarios < 1:
        return _fail(f"--scenarios must be a positive integer, got {args.scenarios}")
    for name in ("kvmetrics", "vllm"):  # findings are tallied, not logged
        logging.getLogger(name).setLevel(logging.CRITICAL)
    bar = Progress(args.scenarios, enabled=sys.stderr.isatty())
    report = soak(args.scenarios, engines, args.seed, args.accounting, args.verify,
                  recovery=args.recovery,
                  on_progress=lambda r: bar.update(r.scenarios // len(engines), r.scenarios))
    bar.close()
    data = report.as_dict()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for key, value in data.items():
            print(f"{key:<22} {value}")
    clean = not (report.invariant_violations or report.guard_rejected_increments
                 or report.verification_failed_blocks or report.errors)
    return 0 if clean or args.accounting == "historical" else 1


def _cmd_workloads() -> int:
    from kvmetrics.lab.synthetic import DESCRIPTIONS

    width = max(map(len, DESCRIPTIONS))
    for name, text in DESCRIPTIONS.items():
        print(f"{name:<{width}}  {text}")
    return 0


def _cmd_catalogue() -> int:
    from kvmetrics.metrics.catalogue import ALL_METRICS

    for spec in ALL_METRICS:
        labels = ",".join(spec.label_names)
        print(f"{spec.name:<48} {spec.kind:<9} {{{labels}}}")
    return 0


def _fail(message: str) -> int:
    print(f"kvmetrics: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False)
                        else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "soak":
        return _cmd_soak(args)
    if args.command == "workloads":
        return _cmd_workloads()
    if args.command == "catalogue":
        return _cmd_catalogue()
    build_parser().print_help()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
