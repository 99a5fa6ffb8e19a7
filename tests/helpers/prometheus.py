"""A real Prometheus server (the ``prometheus`` binary on PATH) for tests.

    with running_prometheus(["127.0.0.1:9400"], rule_files=[rules]) as prom:
        prom.wait_for_scrape()                       # first sample lands ~6 s after start
        prom.query('sum by (mode) (kvmetrics_kv_load_blocks_total)')
        prom.alerts()

The server gets a temporary config, TSDB folder and log, listens on a free
loopback port, and is stopped (``POST /-/quit``, then killed) when the block
exits. Set ``KVMETRICS_PROMETHEUS`` to use another binary.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.common import free_port

T = TypeVar("T")

PROMETHEUS = os.environ.get("KVMETRICS_PROMETHEUS", "prometheus")


class PrometheusError(RuntimeError):
    """Prometheus did not start, answered an error, or a wait ran out of time."""


def poll(fetch: Callable[[], T | None], timeout: float, what: str,
         interval: float = 0.2) -> T:
    """Call ``fetch`` until it returns something other than None; raise after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise PrometheusError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class PrometheusServer:
    def __init__(self, url: str, process: subprocess.Popen[bytes], workdir: Path,
                 jobs: Sequence[str]) -> None:
        self.url = url
        self.process = process
        self.workdir = workdir
        self.jobs = tuple(jobs)

    # -- HTTP API -----------------------------------------------------------------

    def api(self, path: str, params: Mapping[str, str] | None = None,
            method: str = "GET") -> Any:
        """``data`` of a ``/api/v1/...`` answer; raises PrometheusError on an error status."""
        url = f"{self.url}/api/v1/{path.lstrip('/')}"
        body = None
        if params and method == "GET":
            url += "?" + urllib.parse.urlencode(params)
        elif params:
            body = urllib.parse.urlencode(params).encode()
        request = urllib.request.Request(url, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                payload = json.load(response)
        except urllib.error.HTTPError as e:
            payload = json.loads(e.read() or b"{}")
            raise PrometheusError(f"{path}: HTTP {e.code}: {payload.get('error', '')}") from None
        if payload.get("status") != "success":
            raise PrometheusError(f"{path}: {payload.get('error', payload)}")
        return payload["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; the ``result`` list (for a vector: ``{"metric", "value"}`` items)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", params, method="POST")["result"]

    def query_value(self, expr: str) -> float | None:
        """The single value of a one-element vector or scalar result (None if empty)."""
        data = self.api("query", {"query": expr}, method="POST")
        if data["resultType"] == "scalar":
            return float(data["result"][1])
        result = data["result"]
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusError(f"{expr!r} returned {len(result)} series, expected one")
        return float(result[0]["value"][1])

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]

    def rules(self) -> list[dict[str, Any]]:
        return self.api("rules")["groups"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets")["activeTargets"]

    # -- waiting ------------------------------------------------------------------

    def wait_for_scrape(self, after: float | None = None, timeout: float = 30.0,
                        jobs: Sequence[str] | None = None) -> float:
        """Wait until every job (or those named) has a successful scrape that started at
        or after ``after`` (a ``time.time()``; default: now). Returns the oldest such
        scrape's time; it can be passed to :meth:`query` as ``at``."""
        since = time.time() if after is None else after
        wanted = tuple(jobs or self.jobs)
        pattern = "|".join(wanted)

        def fetch() -> float | None:
            up = {item["metric"]["job"]: float(item["value"][1])
                  for item in self.query(f'up{{job=~"{pattern}"}}')}
            times = {item["metric"]["job"]: float(item["value"][1])
                     for item in self.query(f'timestamp(up{{job=~"{pattern}"}})')}
            if set(times) != set(wanted) or min(times.values()) < since:
                return None
            if any(value != 1 for value in up.values()):
                return None
            return min(times.values())

        return poll(fetch, timeout, f"a scrape of {wanted} after {since:.3f}")

    def wait_for_alert(self, name: str, state: str = "firing",
                       timeout: float = 30.0) -> dict[str, Any]:
        def fetch() -> dict[str, Any] | None:
            for alert in self.alerts():
                if alert["labels"].get("alertname") == name and alert["state"] == state:
                    return alert
            return None

        return poll(fetch, timeout, f"alert {name} {state}")

    def log(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")

    def log_errors(self) -> str:
        """The log's error lines (what went wrong at start-up, e.g. a bad rule file)."""
        lines = [line for line in self.log().splitlines() if "level=error" in line]
        return "\n".join(lines) or self.log()[-3000:]

    # -- lifecycle ----------------------------------------------------------------

    def reload(self) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/-/reload", method="POST"),
                               timeout=10).close()

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            try:
                urllib.request.urlopen(
                    urllib.request.Request(f"{self.url}/-/quit", method="POST"),
                    timeout=5).close()
                self.process.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=timeout)


def scrape_config(job: str, targets: Sequence[str], *, scheme: str = "http",
                  metrics_path: str = "/metrics", scrape_interval: str = "1s",
                  **extra: Any) -> dict[str, Any]:
    """One ``scrape_configs`` entry (``extra`` is merged in, e.g. ``tls_config``)."""
    return {"job_name": job, "scheme": scheme, "metrics_path": metrics_path,
            "scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
            "static_configs": [{"targets": list(targets)}], **extra}


def _ready(url: str, process: subprocess.Popen[bytes]) -> bool | None:
    if process.poll() is not None:
        return False
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
            return True if response.status == 200 else None
    except OSError:
        return None


@contextmanager
def running_prometheus(
    targets: str | Sequence[str] = (),
    *,
    job: str = "kvmetrics",
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    rule_files: Sequence[str | os.PathLike[str]] = (),
    scrape_configs: Sequence[Mapping[str, Any]] = (),
    extra_args: Sequence[str] = (),
    startup_timeout: float = 30.0,
) -> Iterator[PrometheusServer]:
    """Start Prometheus scraping ``targets`` (``host:port``) as ``job``, plus any further
    ``scrape_configs`` entries; yield a :class:`PrometheusServer`; stop it on exit."""
    if isinstance(targets, str):
        targets = [targets]
    configs = [dict(c) for c in scrape_configs]
    if targets:
        configs.insert(0, scrape_config(job, targets, scrape_interval=scrape_interval))
    config = {
        "global": {"scrape_interval": scrape_interval,
                   "evaluation_interval": evaluation_interval},
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": configs,
    }
    with tempfile.TemporaryDirectory(prefix="kvmetrics-prometheus-") as tmp:
        workdir = Path(tmp)
        config_file = workdir / "prometheus.yml"
        config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
        server = _start(workdir, config_file, [c["job_name"] for c in configs], extra_args,
                        startup_timeout)
        try:
            yield server
        finally:
            server.stop()


def _start(workdir: Path, config_file: Path, jobs: list[str], extra_args: Sequence[str],
           startup_timeout: float, attempts: int = 3) -> PrometheusServer:
    """Start on a free port; retry on another port if the first was taken meanwhile."""
    for attempt in range(attempts):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with (workdir / "prometheus.log").open("wb") as log:
            process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config_file}",
                 f"--storage.tsdb.path={workdir / f'data-{attempt}'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle",
                 *extra_args],
                stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        server = PrometheusServer(url, process, workdir, jobs)
        try:
            ready = poll(lambda s=server: _ready(s.url, s.process), startup_timeout,
                         "Prometheus to become ready", interval=0.1)
        except PrometheusError:
            server.stop()
            raise PrometheusError(f"Prometheus not ready:\n{server.log_errors()}") from None
        if ready:
            return server
        if "address already in use" not in server.log():
            raise PrometheusError(f"Prometheus exited with {process.returncode}:\n"
                                  f"{server.log_errors()}")
    raise PrometheusError(f"no free port for Prometheus after {attempts} attempts")
