"""One JSON file and a readable summary from the parts of ``scripts/gpu-check.sh``.

Each stage of :mod:`benchmarks.gpu_check` runs in its own process under a time
limit and leaves ``<stage>.json`` in a scratch folder; the script records each
stage's exit status, seconds and limit in ``status.tsv`` there. This module only
reads and writes plain data (no torch), so that a stage that crashed or ran out
of time still shows up, flagged, in the one file that comes back from the GPU.

    python -m benchmarks.gpu_report PARTS_DIR OUTPUT.json
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "kvmetrics-gpu-check/1"
#: Exit status of ``timeout`` when it stopped a stage (TERM, or KILL after the grace).
TIMED_OUT = (124, 137)


@dataclass(frozen=True)
class StageStatus:
    """How one stage's process ended, as the script saw it."""

    stage: str
    exit_status: int
    seconds: float
    limit_s: int


def parse_status(text: str) -> list[StageStatus]:
    """``status.tsv``: one ``stage exit seconds limit`` line per stage run."""
    rows = []
    for line in text.splitlines():
        if line.strip():
            stage, code, seconds, limit = line.split()
            rows.append(StageStatus(stage, int(code), float(seconds), int(limit)))
    return rows


def _verdict(status: StageStatus, part: dict[str, Any] | None) -> str:
    if status.exit_status in TIMED_OUT:
        return "timed out"
    if part is None:
        return "crashed"
    if status.exit_status == 0 and part.get("ok") is True:
        return "passed"
    return "error" if "error" in part else "failed"


def build_result(statuses: list[StageStatus],
                 parts: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The merged figures: every stage the script ran, with its verdict and its part."""
    stages = {}
    for status in statuses:
        part = parts.get(status.stage)
        stages[status.stage] = {"verdict": _verdict(status, part),
                                "exit_status": status.exit_status,
                                "wall_s": status.seconds, "limit_s": status.limit_s,
                                **(part or {})}
    ok = bool(stages) and all(s["verdict"] == "passed" for s in stages.values())
    preflight = parts.get("preflight") or {}
    return {"schema": SCHEMA, "ok": ok, "rehearsal": preflight.get("device_type") != "cuda",
            "stages": stages}


def read_parts(folder: Path) -> dict[str, Any]:
    """The merged result of the parts and ``status.tsv`` in ``folder``."""
    status_file = folder / "status.tsv"
    statuses = parse_status(status_file.read_text()) if status_file.exists() else []
    parts: dict[str, dict[str, Any] | None] = {}
    for status in statuses:
        path = folder / f"{status.stage}.json"
        try:
            parts[status.stage] = json.loads(path.read_text())
        except (OSError, ValueError):
            parts[status.stage] = None
    return build_result(statuses, parts)


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Write the JSON whole or not at all (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(path.name + ".partial")
    scratch.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    os.replace(scratch, path)


def _details(stage: str, s: dict[str, Any]) -> list[str]:
    lines = []
    if stage == "preflight" and s.get("device_type") == "cuda":
        lines.append(f"  {s['device']} (compute {s['capability']}, {s['memory_gib']} GiB), "
                     f"torch {s['torch']}, CUDA {s['cuda']}")
    elif stage == "preflight" and "torch" in s:
        lines.append(f"  the CPU, torch {s['torch']}")
    elif stage == "load" and "copies" in s:
        equal = sum(c["equal"] for c in s["copies"])
        lines.append(f"  batched loads equal to a per-block copy: {equal}/{len(s['copies'])}")
        for e in s.get("engines", []):
            same = e["same_outputs"] and e["same_kv"] and e["same_findings"]
            lines.append(f"  {e['config']}: {e['loaded_blocks']} blocks loaded, "
                         f"{'bit-identical to' if same else 'DIFFERENT from'} the CPU run")
    elif stage == "verify" and "clean" in s:
        clean, broken = s["clean"], s["broken_rollback"]
        lines.append(f"  correct recovery: {clean['findings']} findings over "
                     f"{clean['verified_tokens']} verified tokens")
        lines.append(f"  skipped rollback: {broken['findings']} findings, first: "
                     f"{broken['first']}")
    elif stage == "bench-load" and "rows" in s:
        lines.append(f"  {'layout':>7} {'block':>7} {'batched':>8} {'contig':>8} {'ratio':>6}"
                     "  (GB/s; ratio = batched / contiguous, best of "
                     f"{s.get('repeat')})")
        for r in s["rows"]:
            lines.append(f"  {r['layout']:>7} {int(r['block_bytes']):>6}B "
                         f"{r['batched_gbs']:>8.2f} {r['contiguous_gbs']:>8.2f} "
                         f"{r['ratio']:>6.2f}")
    elif stage == "bench-verify" and "rows" in s:
        for r in s["rows"]:
            if r["mode"] != "off":
                lines.append(f"  verification {r['mode']}: {r['ns_per_token']:.1f} ns per "
                             f"verified token ({r['verified_tokens']} tokens)")
    return lines


def summary(result: dict[str, Any]) -> str:
    """The result as lines a person reads on the terminal."""
    lines = [f"gpu-check: {'all stages passed' if result['ok'] else 'NOT ALL STAGES PASSED'}"]
    if result["rehearsal"]:
        lines.append("REHEARSAL: not run on a CUDA device; no figure here is a GPU figure")
    for stage, s in result["stages"].items():
        lines.append(f"{stage:<13} {s['verdict']:<10} {s['wall_s']:>6.1f} s "
                     f"(limit {s['limit_s']} s)" + (f": {s['error']}" if "error" in s else ""))
        lines.extend(_details(stage, s))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m benchmarks.gpu_report PARTS_DIR OUTPUT.json", file=sys.stderr)
        return 2
    result = read_parts(Path(args[0]))
    write_result(Path(args[1]), result)
    print(summary(result))
    print(f"figures: {args[1]}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
