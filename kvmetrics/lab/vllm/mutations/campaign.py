"""Run mutants, each in a forked child of a process that has already imported torch and
vLLM's configuration (never a module a mutant replaces), and classify them.

A mutant is INVALID when vLLM alone fails on it (not counted); CRASH when the
instrumented run raised or decided, produced or counted (by vLLM's own figures)
anything the uninstrumented run did not; CORRECT when every kvmetrics figure equals
vLLM's; FLAGGED when some differ or are absent and kvmetrics says so (``build_info``
``vllm_verified="false"``, instrumentation errors, self-check failures, the family off
the page or not live); SILENT when they differ and nothing says so.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmetrics.lab.vllm.mutations.generator import Mutant

#: vLLM's figure (:mod:`.worker`) -> (kvmetrics family, label filter) that must equal it.
FIGURES: dict[str, tuple[str, dict[str, str]]] = {
    "preemptions": ("kvmetrics_preemptions_total", {}),
    "evicted_blocks": ("kvmetrics_evicted_blocks_total", {}),
    "recovered_requests": ("kvmetrics_kv_load_failed_requests_total",
                           {"action": "rescheduled"}),
    "load_failed_blocks": ("kvmetrics_kv_load_blocks_total", {"outcome": "failed"}),
    **{f"finished_{reason}": ("kvmetrics_finished_requests_total", {"reason": reason})
       for reason in ("stopped", "length", "aborted", "error")},
}
CHILD_TIMEOUT_S = 600


@dataclass
class Outcome:
    mutant_id: str
    mutant: Mutant | None
    verdict: str
    differs: str = ""
    flags: str = ""


def samples(page: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in page.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split('",') if "=" in p)
        out.append((name, {k: v.strip('"') for k, v in pairs.items()}, float(value)))
    return out


def kvmetrics_figure(page: str, family: str, where: dict[str, str]) -> float | None:
    """The family's total over matching series (None: the family is off the page)."""
    found = [(labels, v) for name, labels, v in samples(page) if name == family]
    if not found:
        return None
    return sum(v for labels, v in found if all(labels.get(k) == w for k, w in where.items()))


def flags(page: str, families: set[str]) -> list[str]:
    """What on the page says that these families may be wrong."""
    said = []
    for name, labels, value in samples(page):
        if name == "kvmetrics_build_info" and labels.get("vllm_verified") == "false":
            said.append("vllm_verified=false")
        elif name == "kvmetrics_instrumentation_errors_total" and value > 0:
            said.append(f"instrumentation_errors{{{labels.get('hook')}}}")
        elif name == "kvmetrics_self_check_failures_total" and value > 0:
            said.append(f"self_check_failures{{{labels.get('check')}}}")
        elif (name == "kvmetrics_family_live" and labels.get("family") in families
              and value == 0):
            said.append(f"family_live{{{labels.get('family')}}}=0")
    return said


def classify(mutant_id: str, mutant: Mutant | None, result: dict[str, Any]) -> Outcome:
    plain, inst = result.get("plain", {}), result.get("instrumented", {})
    if plain.get("error"):
        return Outcome(mutant_id, mutant, "INVALID", differs=str(plain["error"]))
    if inst.get("error"):
        return Outcome(mutant_id, mutant, "CRASH", differs=str(inst["error"]))
    for key in ("decisions", "outcomes", "figures"):
        if plain[key] != inst[key]:
            return Outcome(mutant_id, mutant, "CRASH", differs=f"{key} changed by kvmetrics")
    page, theirs = inst["page"], plain["figures"]
    wrong = {}
    for figure, (family, where) in FIGURES.items():
        ours = kvmetrics_figure(page, family, where)
        if ours is None or ours != theirs.get(figure, 0):
            wrong[figure] = (family, ours, theirs.get(figure, 0))
    if not wrong:
        return Outcome(mutant_id, mutant, "CORRECT")
    differs = ", ".join(f"{f} kvmetrics={o} vllm={t}" for f, (_, o, t) in wrong.items())
    absent = [f"{fam} absent" for fam, o, _ in wrong.values() if o is None]
    said = flags(page, {fam for fam, _, _ in wrong.values()}) + absent
    return Outcome(mutant_id, mutant, "FLAGGED" if said else "SILENT", differs,
                   "; ".join(dict.fromkeys(said)))


def _child(mutant: Mutant | None, folder: Path) -> None:
    from kvmetrics.lab.vllm.mutations import worker

    log = os.open(folder / "child.log", os.O_WRONLY | os.O_CREAT, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for module, source in (mutant.sources if mutant is not None else {}).items():
        package, _, leaf = module.rpartition(".")
        where = folder / package
        where.mkdir(exist_ok=True)
        (where / f"{leaf}.py").write_text(source, encoding="utf-8")
        worker.overlay(module, str(where))
    worker.run_both(lambda name, result: (folder / f"{name}.json").write_text(
        json.dumps(result), encoding="utf-8"))


def _results(folder: Path) -> dict[str, Any]:
    """What the child wrote; a run it did not finish is an error naming its last words."""
    results: dict[str, Any] = {}
    log = folder / "child.log"
    last = (log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
            if log.exists() else [])
    for name in ("plain", "instrumented"):
        path = folder / f"{name}.json"
        results[name] = (json.loads(path.read_text(encoding="utf-8")) if path.exists()
                         else {"error": "the process died: " + (last[-1] if last else "?")})
    return results


def run_all(mutants: list[Mutant | None], jobs: int = 1,
            progress: Any = None) -> list[Outcome]:
    """Each mutant (None: vLLM unchanged) in its own forked child, ``jobs`` at a time."""
    import importlib

    from kvmetrics.lab.vllm.mutations import worker

    for name in worker.WARM_IMPORTS:
        importlib.import_module(name)
    loaded = sorted({m for mutant in mutants if mutant is not None for m in mutant.sources
                     if m in sys.modules})
    if loaded:  # a forked child would run the installed module, not the mutant
        raise RuntimeError("run mutants from a fresh process: already imported here: "
                           + ", ".join(loaded))
    outcomes: dict[int, Outcome] = {}
    running: dict[int, tuple[int, Path, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmetrics-mutants-") as scratch:
        queue = list(enumerate(mutants))
        while queue or running:
            while queue and len(running) < jobs:
                index, mutant = queue.pop(0)
                folder = Path(scratch, f"m{index:03d}")
                folder.mkdir()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child
                    code = 0
                    try:
                        _child(mutant, folder)
                    except BaseException:  # noqa: BLE001 - reported by the parent
                        traceback.print_exc()
                        code = 1
                    os._exit(code)
                running[pid] = (index, folder, time.monotonic())
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                for child, (_, _, started) in running.items():
                    if time.monotonic() - started > CHILD_TIMEOUT_S:
                        os.kill(child, signal.SIGKILL)
                time.sleep(0.2)
                continue
            index, folder, _ = running.pop(pid)
            outcomes[index] = classify(f"m{index:03d}", mutants[index], _results(folder))
            if progress is not None:
                progress(outcomes[index])
    return [outcomes[i] for i in range(len(mutants))]


def row(outcome: Outcome) -> str:
    m = outcome.mutant
    module, operator, site = ((m.module, m.operator, m.site) if m is not None
                              else ("-", "none (vLLM unchanged)", "-"))
    return (f"{outcome.mutant_id}  {module}  {operator}  {site}  {outcome.verdict}"
            f"  differs: {outcome.differs or '-'}  flags: {outcome.flags or '-'}")
