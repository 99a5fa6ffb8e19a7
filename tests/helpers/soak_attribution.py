"""Which documented vLLM patch removes a failing soak seed's stale reads.

An oracle the lab's own classifier does not share: each seed's scenario runs on
vLLM's real scheduler as shipped, then with the patch series of
``docs/vllm-patches/`` applied up to each of its patches (to a scratch copy of the
installed scheduler, as :mod:`kvmetrics.lab.vllm.patched` does for the canaries; the
last is the whole series). A seed whose stale reads vanish once a patch is added is
attributed to that patch's defects.

    python -m tests.helpers.soak_attribution 3 33 37 43
    python -m tests.helpers.soak_attribution --from-report soak.json

Prints a Markdown table of stale blocks read per seed (``reduced by`` gives the
count left with each patch that lowers it); docs/vllm-research.md ("Soak") records a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvmetrics.lab.soak import run_scenario
from kvmetrics.lab.vllm import builder
from kvmetrics.lab.vllm.patched import installed_series, patched_target
from kvmetrics.vllm.scheduler import InstrumentedMixin

#: Instrumented scheduler classes over patched vLLM, built once per set of patches:
#: copying, patching and importing vLLM's scheduler takes about a second, and a full
#: attribution needs (patches + 2) x seeds scenarios.
_built: dict[tuple[str, ...], tuple[type, type]] = {}


def _classes(patches: list[Path]) -> tuple[type, type]:
    key = tuple(p.stem for p in patches)
    if key not in _built:
        scratch = Path(tempfile.mkdtemp(prefix="kvmetrics-attribution-"))
        target = patched_target(patches, scratch)
        _built[key] = (
            # The protective recovery joins at construction when it is on.
            type("PatchedInstrumented", (InstrumentedMixin, target.scheduler), {}),
            type("PatchedInstrumentedAsync", (InstrumentedMixin, target.async_scheduler), {}))
    return _built[key]


@contextmanager
def scheduler_with(patches: list[Path]) -> Iterator[None]:
    """The lab's vLLM engine builds its instrumented scheduler over patched vLLM."""
    sync, asynchronous = _classes(patches)
    original = builder.instrumented_cls
    builder.instrumented_cls = (  # type: ignore[assignment]
        lambda config: asynchronous if config.async_scheduling else sync)
    try:
        yield
    finally:
        builder.instrumented_cls = original  # type: ignore[assignment]


def stale_blocks(seed: int, patches: list[Path] | None) -> int:
    if patches is None:
        outcome = run_scenario(seed, "vllm")
    else:
        with scheduler_with(patches):
            outcome = run_scenario(seed, "vllm")
    if outcome.error:
        raise RuntimeError(f"seed {seed}: {outcome.error}")
    return outcome.verification_failed_blocks


def attribute(seeds: Sequence[int]) -> list[dict[str, object]]:
    patches = installed_series()
    rows = []
    for seed in seeds:
        row: dict[str, object] = {"seed": seed, "vllm": stale_blocks(seed, None)}
        for count, patch in enumerate(patches, 1):
            row[patch.stem] = stale_blocks(seed, patches[:count])
        row["all patches"] = row[patches[-1].stem]
        # The first patch whose addition leaves no stale read (the series is cumulative).
        row["fixed by"] = next((p.stem for p in patches if row[p.stem] == 0),
                               "-") if row["vllm"] else "-"
        row["reduced by"] = ", ".join(
            f"{p.stem} ({row[p.stem]})" for p in patches
            if 0 < row[p.stem] < row["vllm"]) or "-"  # type: ignore[operator]
        rows.append(row)
        print(f"seed {seed}: {row['fixed by']}", file=sys.stderr)
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    keys = ["seed", "vllm", "all patches", "fixed by", "reduced by"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    alone: dict[str, int] = {}
    for row in rows:
        for name in str(row["fixed by"]).split(", "):
            if name != "-":
                alone[name] = alone.get(name, 0) + 1
    several = sum(row["fixed by"] == "-" for row in rows)
    lines += ["", f"{len(rows)} seeds; all patches leave "
              f"{sum(row['all patches'] != 0 for row in rows)} with a stale read; fixed once the "
              "series reaches: " + (", ".join(f"{k} {v}" for k, v in sorted(alone.items()))
                                    or "none")
              + f"; not fixed: {several}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.soak_attribution",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("seeds", nargs="*", type=int)
    parser.add_argument("--from-report", type=Path, help="a `kvmetrics soak --json` report")
    parser.add_argument("--limit", type=int, default=None,
                        help="first N failing seeds (default: all of them)")
    args = parser.parse_args(argv)
    seeds = list(args.seeds)
    if args.from_report:
        report = json.loads(args.from_report.read_text())
        seeds += sorted({f["seed"] for f in report["failures"] if f["engine"] == "vllm"})
    seeds = seeds[:args.limit] if args.limit else seeds
    if not seeds:
        parser.error("no seeds: give some or --from-report")
    print(markdown(attribute(seeds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
