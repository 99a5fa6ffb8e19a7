"""Paths as hostile input (issue 28, cases 6, 9 and 16): an output naming a device, FIFO,
directory or hard-linked file is refused before the run; an input that is /dev/zero,
a FIFO, a sparse 2 GB file, a 5,000-digit number or a trace with duplicate ids is one
line, not a hang, a MemoryError or a traceback; a failed write loses no summary; the
vLLM port file cannot be redirected through a planted link.

Run as root (CI does, as most containers): ``mknod`` is root-only, and root is the user
for whom ``os.access`` says yes to everything, so only the real checks stand.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab_support import console_script, run_cli

QUICK_RUN = ("run", "--verify", "off", "--max-requests", "5")


def _one_line_error(result: subprocess.CompletedProcess[str], *needles: str,
                    code: int = 2) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _null_device(path: Path) -> Path:
    """A copy of /dev/null (character device 1:3), as ``mknod PATH c 1 3`` makes it.
    Never the machine's own /dev/null: on a regression the test would replace it."""
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return path


def _special(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"target-{kind}"
    if kind == "chardev":
        _null_device(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    return path


def _soak_shard(tmp_path: Path) -> Path:
    shard = tmp_path / "shard.json"
    result = run_cli("soak", "--scenarios", "2", "--verify", "off", "--output", str(shard))
    assert result.returncode == 0, result.stderr
    return shard


@pytest.mark.parametrize(("command", "kind"), [
    *((command, "chardev") for command in ("run --output", "run --report", "soak --output",
                                           "soak-merge --output", "report --output")),
    *(("run --output", kind) for kind in ("fifo", "directory", "socket")),
    ("run --report", "fifo"),
])
def test_an_output_that_is_not_a_regular_file_is_refused_before_any_work(
        tmp_path: Path, kind: str, command: str) -> None:
    target = _special(tmp_path, kind)
    before = os.lstat(target)
    name, option = command.split()
    if name == "run":
        argv = [*QUICK_RUN, option, str(target)]
    elif name == "soak":
        argv = ["soak", "--scenarios", "2", "--verify", "off", option, str(target)]
    elif name == "soak-merge":
        argv = ["soak-merge", str(_soak_shard(tmp_path)), option, str(target)]
    else:
        saved = tmp_path / "run.json"
        assert run_cli(*QUICK_RUN, "--output", str(saved)).returncode == 0
        argv = ["report", str(saved), option, str(target)]
    result = run_cli(*argv)
    what = {"chardev": "character device", "fifo": "FIFO", "directory": "directory",
            "socket": "socket"}[kind]
    _one_line_error(result, option, str(target), what)
    assert result.stdout == ""  # refused before the run: no summary, no report
    after = os.lstat(target)
    assert (stat.S_IFMT(after.st_mode), after.st_rdev, after.st_ino) == \
        (stat.S_IFMT(before.st_mode), before.st_rdev, before.st_ino)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_an_existing_output_keeps_its_mode_and_a_link_stays_a_link(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    out.write_text("earlier\n")
    out.chmod(0o640)
    real = tmp_path / "real.html"
    real.write_text("earlier\n")
    real.chmod(0o604)
    link = tmp_path / "link.html"
    link.symlink_to(real.name)
    result = run_cli(*QUICK_RUN, "--output", str(out), "--report", str(link))
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert json.loads(out.read_text())["requests"]["submitted"] == 5
    assert link.is_symlink() and os.readlink(link) == real.name
    assert stat.S_IMODE(real.stat().st_mode) == 0o604
    assert "<svg" in real.read_text()


def test_a_new_output_gets_the_umask_mode(tmp_path: Path) -> None:
    out = tmp_path / "new.json"
    code = ("import os, sys; os.umask(0o027); from kvmetrics.cli.main import main; "
            f"sys.exit(main({[*QUICK_RUN, '--output', str(out)]!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_a_hard_linked_output_is_refused_not_split(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    out.write_text("earlier\n")
    other = tmp_path / "other-name.json"
    os.link(out, other)
    _one_line_error(run_cli(*QUICK_RUN, "--output", str(out)), "2 hard links")
    assert out.read_text() == other.read_text() == "earlier\n"
    assert out.stat().st_ino == other.stat().st_ino


def test_an_unwritable_place_is_refused_before_the_run() -> None:
    result = run_cli(*QUICK_RUN, "--output", "/proc/x.json")
    _one_line_error(result, "--output", "cannot write in /proc")
    assert result.stdout == ""


def _limited_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_failed_write_after_the_run_keeps_the_summary_and_the_old_file(
        tmp_path: Path) -> None:
    """A file-size limit makes every write over 4 KB fail as a full disk would (EFBIG
    rather than ENOSPC: the same failed write, without mounting a filesystem)."""
    out = tmp_path / "run.json"
    out.write_text("earlier\n")
    result = subprocess.run([console_script(), *QUICK_RUN, "--output", str(out)],
                            capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL, preexec_fn=_limited_file_size(4096))
    _one_line_error(result, f"cannot write {out}", "File too large", code=4)
    assert "5 submitted, 5 finished" in result.stdout  # the summary came first
    assert out.read_text() == "earlier\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temp file left


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "directory"])
@pytest.mark.parametrize("what", ["trace", "fault plan", "soak shard", "run JSON"])
def test_an_input_that_is_not_a_regular_file_is_one_line(tmp_path: Path, kind: str,
                                                         what: str) -> None:
    path = kind if kind == "/dev/zero" else str(_special(tmp_path, kind))
    argv = {"trace": [*QUICK_RUN, "--trace", path],
            "fault plan": [*QUICK_RUN, "--fault-plan", path],
            "soak shard": ["soak-merge", path],
            "run JSON": ["report", path, "-o", str(tmp_path / "r.html")]}[what]
    # A FIFO with no writer used to block forever: the timeout makes that a failure.
    result = run_cli(*argv, timeout=120)
    kind_name = {"/dev/zero": "character device", "fifo": "FIFO", "directory": "directory"}
    line = _one_line_error(result, path)
    assert kind_name[kind] in line or "Is a directory" in line, line


def _peak_rss_kb(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run the console script from a fresh process and return its peak RSS (KB)."""
    code = ("import resource, subprocess, sys, json; "
            f"r = subprocess.run({argv!r}, capture_output=True, text=True, "
            "stdin=subprocess.DEVNULL); "
            "print(json.dumps([r.returncode, r.stdout, r.stderr, "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    rc, stdout, stderr, rss = json.loads(out)
    return subprocess.CompletedProcess(argv, rc, stdout, stderr), rss


@pytest.mark.parametrize(("size", "needle"), [
    (2 * 2**30, "over the limit of 1,073,741,824"),   # refused by its size
    (512 * 2**20, "line longer than 16,777,216 bytes"),  # under it: by its first line
])
def test_a_sparse_trace_is_refused_without_reading_it(tmp_path: Path, size: int,
                                                      needle: str) -> None:
    trace = tmp_path / "sparse.jsonl"
    with trace.open("wb") as handle:
        handle.truncate(size)
    result, rss_kb = _peak_rss_kb([console_script(), *QUICK_RUN, "--trace", str(trace)])
    _one_line_error(result, needle)
    assert rss_kb < 400_000, f"peak RSS {rss_kb} KB"  # it was 2.1 GB


@pytest.mark.parametrize("what", ["trace", "fault plan", "soak shard", "run JSON"])
def test_a_5000_digit_integer_is_one_line(tmp_path: Path, what: str) -> None:
    huge = "1" + "0" * 5000
    path = tmp_path / "input.json"
    if what == "trace":
        path.write_text(f'{{"arrival_s": 0, "prompt_token_ids": [1], "output_length": {huge}}}\n')
        argv = [*QUICK_RUN, "--trace", str(path)]
    elif what == "fault plan":
        path.write_text(f'{{"rate": 0.1, "seed": {huge}}}')
        argv = [*QUICK_RUN, "--fault-plan", str(path)]
    elif what == "soak shard":
        path.write_text(f'{{"version": 2, "scenarios": {huge}}}')
        argv = ["soak-merge", str(path)]
    else:
        path.write_text(f'{{"steps": {huge}}}')
        argv = ["report", str(path), "-o", str(tmp_path / "r.html")]
    _one_line_error(run_cli(*argv), "an integer of 5,001 digits")


def test_duplicate_request_ids_are_refused_before_the_run(tmp_path: Path) -> None:
    trace = tmp_path / "dup.jsonl"
    line = {"arrival_s": 0, "prompt_token_ids": [1, 2], "output_length": 2}
    trace.write_text("".join(json.dumps({**line, "id": rid}) + "\n" for rid in "aba"))
    out = tmp_path / "run.json"
    result = run_cli(*QUICK_RUN, "--trace", str(trace), "--output", str(out))
    _one_line_error(result, "dup.jsonl:3", "duplicate request id 'a' (first on line 1)")
    assert result.stdout == "" and not out.exists()


def test_the_helpers_refuse_what_the_cli_refuses(tmp_path: Path) -> None:
    from kvmetrics.metrics import files

    device = _null_device(tmp_path / "null")
    with pytest.raises(files.FileRefused, match="character device"):
        files.write_file(str(device), "x")
    with pytest.raises(files.FileRefused, match="over the limit of 10"):
        files.read_bytes(_write(tmp_path / "big", b"x" * 11), limit=10)
    assert files.read_bytes(_write(tmp_path / "ok", b"x" * 10), limit=10) == b"x" * 10
    assert stat.S_ISCHR(os.lstat(device).st_mode)


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_the_port_file_cannot_be_redirected_by_a_planted_link(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's EngineCore writes KVMETRICS_METRICS_PORT_FILE; it used to go through
    ``PATH.PID.tmp``, so a link planted there overwrote the link's target."""
    from kvmetrics.vllm.exporting import _write_port_file

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    port_file = tmp_path / "port"
    for pid in {os.getpid(), os.getppid()}:
        (tmp_path / f"port.{pid}.tmp").symlink_to(victim)
    monkeypatch.setenv("KVMETRICS_METRICS_PORT_FILE", str(port_file))
    _write_port_file(43210)
    assert port_file.read_text() == "43210\n"
    assert victim.read_text() == "precious\n"
    assert not port_file.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_the_port_file_never_replaces_a_device(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    from kvmetrics.vllm.exporting import _write_port_file

    device = _null_device(tmp_path / "port")
    monkeypatch.setenv("KVMETRICS_METRICS_PORT_FILE", str(device))
    _write_port_file(43210)  # logged, never raised: the engine comes up regardless
    assert stat.S_ISCHR(os.lstat(device).st_mode)
    assert "character device" in caplog.text


def test_demo_model_writes_through_the_safe_writer(tmp_path: Path) -> None:
    """``kvmetrics demo-model`` wrote its weights through ``.model.safetensors.tmp``: a
    link planted there overwrote the link's target; a device at config.json was
    replaced."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (folder / ".model.safetensors.tmp").symlink_to(victim)
    device = _null_device(folder / "config.json")
    _one_line_error(run_cli("demo-model", str(folder)), "config.json", "character device")
    assert stat.S_ISCHR(os.lstat(device).st_mode)
    device.unlink()
    result = run_cli("demo-model", str(folder))
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "precious\n"
    assert json.loads((folder / "config.json").read_text())
    assert (folder / "model.safetensors").stat().st_size > 1000


def test_demo_model_names_a_dangling_link(tmp_path: Path) -> None:
    """A model folder that is a link to nothing gets the link's target named, not the
    bare "File exists" that mkdir answers."""
    folder = tmp_path / "tiny"
    folder.symlink_to(tmp_path / "gone")
    _one_line_error(run_cli("demo-model", str(folder)), "is a link to", "gone",
                    "does not exist")
