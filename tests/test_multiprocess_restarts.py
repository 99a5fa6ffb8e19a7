"""Multiprocess mode through restarts and bad files (issue 20, point 5): engine processes
that are killed with SIGKILL and restarted, or exit cleanly, leave no gauges behind, and
an unreadable ``*.db`` file is skipped and counted instead of failing every scrape."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.metrics import catalogue as cat

pytestmark = pytest.mark.prometheus

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def mpdir(tmp_path: Path) -> Path:
    path = tmp_path / "multiproc"
    path.mkdir()
    return path


def _env(mpdir: Path) -> dict[str, str]:
    return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mpdir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")]))}


def _worker(mpdir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.mp_worker", *args], cwd=REPO,
                            env=_env(mpdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _at_checkpoint(mpdir: Path, engine: str, seed: str, out: Path) -> subprocess.Popen[str]:
    proc = _worker(mpdir, "run", engine, seed, str(out), "12")
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "checkpoint", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


def _page(mpdir: Path, tmp_path: Path) -> str:
    out = tmp_path / "page.txt"
    render = _worker(mpdir, "render", str(out))
    _, err = render.communicate(timeout=120)
    assert render.returncode == 0, err[-2000:]
    return out.read_text()


def _gauges(page: str, engine: str) -> dict[tuple[str, tuple[str, ...]], float]:
    found = {}
    for family in text_string_to_metric_families(page):
        if family.type != "gauge" or not family.name.startswith("kvmetrics_"):
            continue
        for s in family.samples:
            if s.labels.get("engine") == engine:
                own = tuple(v for k, v in sorted(s.labels.items())
                            if k not in ("engine", "model_name"))
                found[(s.name, own)] = s.value
    return found


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_a_killed_and_restarted_engine_shows_only_the_live_processs_gauges(
        mpdir: Path, tmp_path: Path) -> None:
    first = _at_checkpoint(mpdir, "1", "21", tmp_path / "first.json")
    os.kill(first.pid, signal.SIGKILL)  # no hook runs
    assert first.wait(timeout=30) == -signal.SIGKILL
    second = _at_checkpoint(mpdir, "1", "22", tmp_path / "second.json")
    try:
        page = _page(mpdir, tmp_path)
    finally:
        _kill(second)
    expected = json.loads((tmp_path / "second.json.gauges.json").read_text())
    shown = _gauges(page, "1")
    requests = {k: v for k, v in shown.items() if k[0] == cat.REQUESTS.name}
    assert requests == {(cat.REQUESTS.name, tuple(values)): value
                        for name, values, value in expected if name == cat.REQUESTS.name}
    assert shown[(cat.KV_CACHE_BLOCKS.name, ())] == next(
        v for n, _, v in expected if n == cat.KV_CACHE_BLOCKS.name)
    assert [line for line in page.splitlines() if line.startswith("kvmetrics_build_info{")
            ] == [line for line in page.splitlines()
                  if line.startswith("kvmetrics_build_info{") and line.endswith(" 1.0")]


def test_an_engine_that_exits_cleanly_takes_its_gauges_with_it(
        mpdir: Path, tmp_path: Path) -> None:
    done = _worker(mpdir, "run", "2", "23", str(tmp_path / "done.json"))
    _, err = done.communicate(timeout=120)
    assert done.returncode == 0, err[-2000:]
    assert not list(mpdir.glob("gauge_live*.db"))
    page = _page(mpdir, tmp_path)
    assert _gauges(page, "2") == {}
    assert 'kvmetrics_preemptions_total{engine="2"' in page  # counters outlive the process


def test_unreadable_db_files_are_skipped_and_counted_not_a_500(
        mpdir: Path, tmp_path: Path) -> None:
    done = _worker(mpdir, "run", "3", "24", str(tmp_path / "done.json"))
    _, err = done.communicate(timeout=120)
    assert done.returncode == 0, err[-2000:]
    real = sorted(mpdir.glob("counter_*.db"))[0]
    (mpdir / "counter_999999.db").write_bytes(b"")  # empty
    (mpdir / "counter_999998.db").write_bytes(real.read_bytes()[:20])  # truncated
    page = _page(mpdir, tmp_path)
    skipped = sum(s.value for f in text_string_to_metric_families(page) for s in f.samples
                  if s.name == cat.SCRAPE_ERRORS.name
                  and s.labels.get("reason") == "unreadable_multiprocess_file")
    assert skipped == 2
    assert 'kvmetrics_preemptions_total{engine="3"' in page  # the readable files still count
    check = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and not check.stdout.strip(), check
