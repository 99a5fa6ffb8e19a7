"""TLS and label values from the command line (issue 20, points 2 and 8): `kvmetrics run
--serve ... --serve-tls-*` serves mutual TLS, and a bad TLS file or label value stops
the run at startup with one line and exit 2 (never a run whose every scrape fails)."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks.common import free_port
from benchmarks.tls import TLSMaterial, make_tls_material
from tests.lab_support import console_script

QUICK = ["--max-requests", "10", "--verify", "off", "--no-progress"]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSMaterial:
    return make_tls_material(tmp_path_factory.mktemp("tls"))


def _run(*args: str | bytes) -> subprocess.CompletedProcess[str]:
    return subprocess.run([console_script(), "run", *QUICK, *args], capture_output=True,
                          text=True, errors="replace", timeout=300, stdin=subprocess.DEVNULL)


def _one_line_exit_2(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(("value", "needle"), [
    (b"caf\xe9", "not valid UTF-8"), ("m" * 500, "at most 128"), ("a\nb", "control"),
    ("", "empty")])
def test_an_unusable_model_name_stops_the_run(value: str | bytes, needle: str) -> None:
    _one_line_exit_2(_run("--model-name", value), "--model-name", needle)


def test_a_missing_tls_file_stops_the_run(tls: TLSMaterial, tmp_path: Path) -> None:
    missing = tmp_path / "nope.crt"
    _one_line_exit_2(_run("--serve", f"127.0.0.1:{free_port()}", "--serve-tls-cert",
                          str(missing), "--serve-tls-key", str(tls.server_key)),
                     "cannot load TLS certificate", "nope.crt")


def test_a_key_that_is_not_pem_stops_the_run(tls: TLSMaterial, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"\xff\xfenot a key\n")
    _one_line_exit_2(_run("--serve", f"127.0.0.1:{free_port()}", "--serve-tls-cert",
                          str(tls.server_cert), "--serve-tls-key", str(garbage)),
                     "cannot load TLS certificate", "garbage.key")


def test_tls_options_without_serve_are_refused(tls: TLSMaterial) -> None:
    _one_line_exit_2(_run("--serve-tls-cert", str(tls.server_cert)), "need --serve")


def test_run_serves_mutual_tls(tls: TLSMaterial) -> None:
    port = free_port()
    process = subprocess.Popen(
        [console_script(), "run", *QUICK, "--serve", f"127.0.0.1:{port}",
         "--wait-for-scrape", "60", "--serve-tls-cert", str(tls.server_cert),
         "--serve-tls-key", str(tls.server_key), "--serve-tls-client-ca", str(tls.ca_cert)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    url = f"https://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url, context=tls.client_context(),
                                            timeout=5) as response:
                    page = response.read().decode()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.2)
        assert 'kvmetrics_build_info{engine="0"' in page
        with pytest.raises(OSError):  # no client certificate: no page
            urllib.request.urlopen(url, context=tls.client_context(with_cert=False),
                                   timeout=5).read()
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
