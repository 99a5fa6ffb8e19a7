"""Runs and soaks stop cleanly: SIGINT/SIGTERM/SIGHUP give the summary so far, the
outputs, exit 130/143/129, no traceback and no process left; a soak worker killed with -9 costs
its one scenario, not the campaign."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.lab_support import console_script

EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc, no psutil needed)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class _Cli:
    """The real console script in its own process group, its stderr read line by line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([console_script(), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            match = re.search(pattern, line)
            if match:
                return match
        self.proc.kill()
        raise AssertionError(f"no {pattern!r} on stderr: {''.join(self.stderr)}")

    def signal(self, sig: int, group: bool) -> None:
        """SIGINT to the process group, as a terminal's Ctrl-C; SIGTERM to the pid;
        SIGHUP either way (a shell forwards a hangup to its jobs' groups)."""
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        assert self.proc.stdout is not None
        stdout = self.proc.stdout.read()
        self.proc.wait(timeout)
        self.reader.join(timeout)  # stderr's last lines
        return self.proc.returncode, stdout, "".join(self.stderr)


def _assert_all_gone(pids: set[int]) -> None:
    """Workers and the resource tracker end with the command (the tracker on EOF of its
    pipe, within moments): wait on the condition, bounded."""
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "processes left behind"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_run_stopped_while_lingering(tmp_path: Path, sig: int) -> None:
    out, page = tmp_path / "run.json", tmp_path / "run.html"
    cli = _Cli("run", "--verify", "off", "--max-requests", "20", "--serve", "127.0.0.1:0",
               "--linger", "120", "--output", str(out), "--report", str(page))
    cli.wait_for(r"serving metrics on http://127\.0\.0\.1:\d+/metrics")
    cli.wait_for(r"run written to .*run\.json")
    cli.wait_for(r"report written to .*run\.html")
    cli.wait_for(r"lingering 120 s")
    # Written before the linger: a signal now loses nothing.
    assert json.loads(out.read_text())["requests"]["submitted"] == 20
    assert "<svg" in page.read_text()
    cli.signal(sig, group=sig != signal.SIGTERM)
    code, stdout, stderr = cli.finish()
    assert code == EXIT[sig], stderr
    assert "Traceback" not in stderr
    assert "steps / wall time" in stdout  # the summary was printed
    assert f"interrupted ({signal.Signals(sig).name})" in stderr
    _assert_all_gone({cli.proc.pid})


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_run_stopped_mid_run_writes_the_steps_so_far(tmp_path: Path, sig: int) -> None:
    out = tmp_path / "run.json"
    cli = _Cli("run", "--verify", "off", "--max-requests", "300", "--realtime",
               "--step-seconds", "0.05", "--serve", "127.0.0.1:0", "--output", str(out),
               "--json")
    cli.wait_for(r"serving metrics on")
    time.sleep(1.0)  # some steps, far from the end (300 requests at 20 steps a second)
    cli.signal(sig, group=sig == signal.SIGINT)  # Ctrl-C reaches the terminal's group
    code, stdout, stderr = cli.finish()
    assert code == EXIT[sig], stderr
    assert "Traceback" not in stderr
    assert f"interrupted ({signal.Signals(sig).name})" in stderr
    saved = json.loads(out.read_text())
    assert saved["interrupted"] == signal.Signals(sig).name
    assert 0 < saved["steps"] == json.loads(stdout)["steps"]
    r = saved["requests"]
    # Only the requests that arrived before the signal count as submitted.
    assert r["finished"] + r["failed"] + r["aborted"] <= r["submitted"] < 300
    assert len(saved["timeline"]["last_step"]) == saved["steps"]


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False),
                                            (signal.SIGHUP, False), (signal.SIGHUP, True)])
def test_soak_with_workers_stopped(tmp_path: Path, sig: int, group: bool) -> None:
    out = tmp_path / "soak.json"
    cli = _Cli("soak", "--scenarios", "3000", "--verify", "off", "--jobs", "2",
               "--output", str(out))
    match = cli.wait_for(r"in 2 worker processes \(pids (\d+) (\d+)\)")
    workers = {int(match.group(1)), int(match.group(2))}
    time.sleep(1.0)
    before = _children(cli.proc.pid)  # the workers, and multiprocessing's tracker if any
    assert workers <= before
    cli.signal(sig, group=group)
    code, stdout, stderr = cli.finish()
    assert code == EXIT[sig], stderr
    assert "Traceback" not in stderr
    report = json.loads(out.read_text())
    assert report["interrupted"] == signal.Signals(sig).name
    assert report["scenarios"] < 3000
    assert re.search(r"^scenarios\s+\d+$", stdout, re.M)
    _assert_all_gone(before | {cli.proc.pid})


def test_soak_worker_killed_costs_one_scenario(tmp_path: Path) -> None:
    cli = _Cli("soak", "--scenarios", "6", "--verify", "off", "--jobs", "2", "--json")
    match = cli.wait_for(r"worker processes \(pids (\d+) (\d+)\)")
    os.kill(int(match.group(1)), signal.SIGKILL)  # as the OOM killer would
    code, stdout, stderr = cli.finish()
    assert code == 1, stderr
    assert "Traceback" not in stderr
    report = json.loads(stdout)
    assert report["scenarios"] == 6 and report["errors"] == 1
    (failure,) = report["failures"]
    assert failure["error"] == "the worker process died (SIGKILL)"


def test_soak_workers_of_a_killed_parent_leave_quietly() -> None:
    """A parent that cannot clean up (kill -9) leaves its workers without a reader:
    each finishes or drops its scenario and exits, with no BrokenPipeError traceback."""
    cli = _Cli("soak", "--scenarios", "3000", "--verify", "off", "--jobs", "2")
    match = cli.wait_for(r"in 2 worker processes \(pids (\d+) (\d+)\)")
    workers = {int(match.group(1)), int(match.group(2))}
    time.sleep(1.0)
    cli.signal(signal.SIGKILL, group=False)
    code, _, stderr = cli.finish()  # stderr ends when the last worker has closed it
    assert code == -signal.SIGKILL
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    _assert_all_gone(workers)


def test_run_on_a_terminal_that_hangs_up_writes_its_output(tmp_path: Path) -> None:
    """The real hangup: the run's terminal (a pty here, its controlling terminal) goes
    away. The kernel sends SIGHUP and every later write to the terminal fails with EIO;
    the progress bar's last redraw and the summary must not stop --output being
    written."""
    import pty
    import select

    out = tmp_path / "run.json"
    master, slave = pty.openpty()
    terminal = os.ttyname(slave)

    def own_terminal() -> None:
        os.setsid()
        os.close(os.open(terminal, os.O_RDWR))  # the first tty opened becomes controlling

    proc = subprocess.Popen([console_script(), "run", "--verify", "off", "--max-requests",
                             "300", "--realtime", "--step-seconds", "0.05", "--output",
                             str(out)], stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=own_terminal)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 120
    try:
        while b"step " not in seen and time.monotonic() < deadline:  # the bar is drawn
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 65536)
    finally:
        os.close(master)  # the terminal hangs up
    code = proc.wait(60)
    assert b"step " in seen, seen[-500:]
    assert code == EXIT[signal.SIGHUP]
    saved = json.loads(out.read_text())
    assert saved["interrupted"] == "SIGHUP" and saved["steps"] > 0
