"""Settings, local files and input files as hostile input: whatever an operator, a
local user or a shard file hands an engine or a command, the answer is one line or a
clean stop, never a traceback, a hang, gigabytes of memory, or a file replaced that is
not ours (tests run as root, as engines in most containers do).

The numeric and type cases are generated from the table of settings
(:data:`kvmetrics.vllm.exporting.SETTINGS`), so a setting added to the
table is covered without a line here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pty
import select
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
import unicodedata
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.tls import TLSMaterial, make_tls_material
from kvmetrics.metrics.labels import derived_label_value, label_value_problem
from kvmetrics.vllm.exporting import (
    SETTINGS,
    ExportSettings,
    _write_port_file,
    build_exporter,
    check_setting_keys,
)
from tests.lab_support import run_cli

NOBODY = 65534


def _config(extra: dict[str, Any] | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0),
        model_config=SimpleNamespace(served_model_name=None, model="/models/opt"),
        additional_config={"kvmetrics": extra} if extra is not None else {})


def _refused(call: Callable[[], object], *needles: str) -> str:
    with pytest.raises(ValueError) as caught:
        call()
    line = str(caught.value)
    assert "\n" not in line and len(line) < 400, line
    for needle in needles:
        assert needle in line, line
    return line


@pytest.fixture(autouse=True)
def _no_inherited_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVMETRICS_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)


# -- the port file -------------------------------------------------------------------

def test_a_link_at_the_port_file_path_is_refused_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A ``nobody``-owned link in a sticky directory must not make root overwrite the root-only
    file it names: the port file is written without following a link at its name."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    victim.chmod(0o600)
    link = shared / "port"
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    monkeypatch.setenv("KVMETRICS_METRICS_PORT_FILE", str(link))
    with caplog.at_level(logging.ERROR, logger="vllm.kvmetrics"):
        _write_port_file(43210)
    assert victim.read_text() == "root:secret\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert link.is_symlink()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "symbolic link" in line and str(link) in line
    assert sorted(p.name for p in shared.iterdir()) == ["port"]  # no temp file left


def test_the_port_file_replaces_no_file_of_another_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    theirs = tmp_path / "port"
    theirs.write_text("planted\n")
    os.chown(theirs, NOBODY, NOBODY)
    monkeypatch.setenv("KVMETRICS_METRICS_PORT_FILE", str(theirs))
    _write_port_file(43210)
    assert theirs.read_text() == "planted\n"
    assert "owned by" in caplog.text
    theirs.unlink()
    _write_port_file(43210)  # a new one, and one of our own, is written
    assert theirs.read_text() == "43210\n"
    _write_port_file(43211)
    assert theirs.read_text() == "43211\n"


# -- TLS files -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSMaterial:
    return make_tls_material(tmp_path_factory.mktemp("tls"))


def _tls_config(tls: TLSMaterial, **change: str) -> SimpleNamespace:
    return _config({"metrics_addr": "127.0.0.1:0", "tls_cert": str(tls.server_cert),
                    "tls_key": str(tls.server_key), "tls_client_ca": str(tls.ca_cert),
                    **change})


def _finishes(call: Callable[[], object], fifo: Path, within: float = 120.0) -> object:
    """``call``'s outcome (result or exception); fails if it was still running after
    ``within`` seconds. The bound only limits how long a failing run takes (a call that
    opens the FIFO never returns by itself), so it is far above what a loaded machine
    needs. A call stuck opening ``fifo`` is then let go (a writer opens and closes it)
    so that the test ends either way."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(within)
    stuck = worker.is_alive()
    while worker.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(0.2)
    assert not stuck, "the call hung on a FIFO"
    return outcome[0]


@pytest.mark.parametrize("which", ["tls_cert", "tls_key", "tls_client_ca"])
def test_a_tls_file_that_is_a_fifo_is_refused_without_opening_it(
        tls: TLSMaterial, tmp_path: Path, which: str) -> None:
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    outcome = _finishes(lambda: check_setting_keys(_tls_config(tls, **{which: str(fifo)})),
                        fifo)
    assert isinstance(outcome, ValueError), outcome
    assert "FIFO" in str(outcome) and "\n" not in str(outcome)


def test_an_encrypted_key_is_refused_without_a_passphrase_prompt(
        tls: TLSMaterial, tmp_path: Path) -> None:
    """OpenSSL asks for the passphrase on the controlling terminal: an engine started
    from one would wait there forever. Run with a terminal, the check must answer."""
    key = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(tls.server_key), "-aes256", "-passout",
                    "pass:secret", "-out", str(key)], check=True, capture_output=True,
                   timeout=60)
    code = ("from kvmetrics.exporters.prometheus import TLSOptions, tls_context\n"
            f"tls_context(TLSOptions({str(tls.server_cert)!r}, {str(key)!r}))\n")
    pid, terminal = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty
        os.execve(sys.executable, [sys.executable, "-c", code], dict(os.environ))
    output = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([terminal], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(terminal, 4096)
                except OSError:
                    break  # the child exited: the terminal closed
                if not chunk:
                    break
                output += chunk
                if b"pass phrase" in output.lower():
                    break
    finally:
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    text = output.decode(errors="replace")
    assert "pass phrase" not in text.lower(), text
    assert "TLSConfigError" in text and "encrypted" in text, text


def test_a_tls_file_over_the_size_bound_is_refused(tls: TLSMaterial, tmp_path: Path) -> None:
    big = tmp_path / "big.pem"
    with open(big, "wb") as handle:
        handle.truncate(2 * 2**30)  # sparse: nothing is read
    _refused(lambda: check_setting_keys(_tls_config(tls, tls_client_ca=str(big))),
             "over the limit")


# -- numbers ---------------------------------------------------------------------------

NUMERIC = [s for s in SETTINGS if s.kind == "number"]
HOSTILE_NUMBERS = ["nan", "NaN", "inf", "-inf", "-1", "-0.5", "1e-300", "1e300", "1e309",
                   "1" + "0" * 400, "0x10", "five", "1_0_0_0_0_0"]


def test_the_table_has_numeric_settings() -> None:
    assert {s.env for s in NUMERIC} >= {"KVMETRICS_SCRAPE_RATE", "KVMETRICS_SCRAPE_MAX_AGE_S"}


def _float_or_nan(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


#: Each numeric setting with each hostile spelling it refuses (``1e-300`` is a page age
#: of zero, which is allowed).
OUT_OF_RANGE = [(s, t) for s in NUMERIC for t in HOSTILE_NUMBERS
                if not s.accepts(_float_or_nan(t))]


@pytest.mark.parametrize(("setting", "text"), OUT_OF_RANGE,
                         ids=[f"{s.env}={t[:12]}" for s, t in OUT_OF_RANGE])
def test_a_numeric_setting_out_of_range_stops_the_engine_with_one_line(
        setting: Any, text: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(setting.env, text)
    _refused(lambda: check_setting_keys(_config()), setting.env, setting.range_text())
    # An endpoint outside vLLM (``kvmetrics run --serve``) keeps its default instead.
    from kvmetrics.exporters.admission import ServerLimits

    with caplog.at_level(logging.WARNING):
        limits = ServerLimits.from_env(os.environ)
    assert limits == ServerLimits()
    (line,) = [r.getMessage() for r in caplog.records if setting.env in r.getMessage()]
    assert setting.range_text() in line and len(line) < 300


@pytest.mark.parametrize("setting", NUMERIC, ids=lambda s: s.env)
def test_a_numeric_setting_accepts_its_documented_range(
        setting: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    values = [setting.low, setting.high, (setting.low + setting.high) / 2]
    if setting.zero_means:
        values.append(0)
    for value in values:
        monkeypatch.setenv(setting.env, repr(value))
        check_setting_keys(_config())
    past = [setting.high * 1.01] + ([setting.low / 2] if setting.low > 0 else [])
    for value in past:
        monkeypatch.setenv(setting.env, repr(value))
        _refused(lambda: check_setting_keys(_config()), setting.env)


def test_a_tiny_scrape_rate_no_longer_serves_one_page_and_then_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmetrics.exporters.admission import ServerLimits

    monkeypatch.setenv("KVMETRICS_SCRAPE_RATE", "1e-300")
    monkeypatch.setenv("KVMETRICS_SCRAPE_MAX_AGE_S", "1e300")
    limits = ServerLimits.from_env(os.environ)
    assert limits.max_requests_per_s == ServerLimits().max_requests_per_s
    assert limits.page_max_age_s == ServerLimits().page_max_age_s


# -- additional_config types -----------------------------------------------------------

WRONG_TYPES: list[Any] = [5, 5.5, [], {}, ["a"], {"a": 1}]


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.key], ids=lambda s: s.key)
@pytest.mark.parametrize("value", WRONG_TYPES + ["maybe", True], ids=repr)
def test_additional_config_values_of_the_wrong_type_are_one_line(setting: Any,
                                                                  value: Any) -> None:
    if setting.kind == "flag" and isinstance(value, bool):
        check_setting_keys(_config({setting.key: value}))
        return
    if setting.kind == "text" and value == "maybe":
        return  # a string: what the setting does with it has tests of its own
    _refused(lambda: check_setting_keys(_config({setting.key: value})),
             f"additional_config.kvmetrics.{setting.key}")


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.kind == "flag"],
                         ids=lambda s: s.env)
def test_flags_take_booleans_and_their_documented_spellings_only(
        setting: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmetrics.vllm.exporting import settings_for

    field = setting.key
    for value, expected in [(True, True), (False, False), ("false", False), ("False", False),
                            ("no", False), ("0", False), ("true", True), ("on", True)]:
        assert getattr(settings_for(_config({field: value}), env={}), field) is expected
    for value in ["flase", "2", "yes please", 1, 0]:
        _refused(partial(check_setting_keys, _config({field: value})), field)
    monkeypatch.setenv(setting.env, "flase")
    _refused(lambda: check_setting_keys(_config()), setting.env)


def test_a_verified_record_needs_a_real_true_for_the_protective_recovery() -> None:
    from kvmetrics.vllm import fingerprints

    files = {"vllm.x": "sha256:1"}
    for flag in ["false", "true", 1, "yes", None]:
        data = {"0.0.1": {"protect_verified": flag, "modules": {"vllm.x": {"file": "sha256:1",
                                                                           "entries": {}}}}}
        result = fingerprints.check(files=files, version="0.0.1", data=data)
        assert result.verified and result.protect_verified is False, flag
        assert fingerprints.protect_allowed(result, env={}) is not None
    data["0.0.1"]["protect_verified"] = True
    assert fingerprints.check(files=files, version="0.0.1", data=data).protect_verified


# -- model_name --------------------------------------------------------------------------

def _invisible() -> list[str]:
    """Every format character (category Cf) and the Hangul fillers."""
    found = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"]
    return found + ["\u115f", "\u1160", "\u3164", "\uffa0"]


INVISIBLE = _invisible()


def test_invisible_characters_never_make_two_labels_that_look_the_same() -> None:
    for char in INVISIBLE:
        value = f"llama{char}-70b"
        problem = label_value_problem(value)
        assert problem is not None and f"U+{ord(char):04X}" in problem, ascii(value)
        derived = derived_label_value(value)
        assert label_value_problem(derived) is None and char not in derived
        assert derived != "llama-70b"


@pytest.mark.parametrize("char", ["\u200b", "\ufeff", "\u3164", "\u2060", "\U000e0041"])
def test_an_explicit_model_name_with_an_invisible_character_stops_the_engine(
        char: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _refused(lambda: check_setting_keys(_config({"model_name": f"m{char}"})),
             "model_name", f"U+{ord(char):04X}")
    monkeypatch.setenv("KVMETRICS_ENGINE", f"0{char}")
    _refused(lambda: check_setting_keys(_config()), "KVMETRICS_ENGINE")


# -- values echoed in log lines ------------------------------------------------------------

def test_a_huge_address_is_refused_and_never_logged_in_full(
        caplog: pytest.LogCaptureFixture) -> None:
    huge = "a" * 70_000 + ":9401"
    _refused(lambda: check_setting_keys(_config({"metrics_addr": huge})), "metrics_addr")
    with caplog.at_level(logging.INFO):
        exporter = build_exporter(ExportSettings(metrics_addr=huge))
        exporter.shutdown()
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(len(line) < 600 for line in lines), [len(x) for x in lines]


# -- soak-merge and report inputs ----------------------------------------------------------

def _hostile_shard(count: int) -> dict[str, Any]:
    from kvmetrics.lab.soak import Campaign, Shard, SoakReport

    campaign = Campaign(10**9, 0, ("reference",), "unified", "off", "vllm")
    return SoakReport(campaign, Shard(0, count)).as_dict()


def test_a_shard_claiming_a_million_shards_costs_no_memory() -> None:
    from kvmetrics.lab.soak import SoakReport, SoakReportError, merge_reports

    report = SoakReport.from_dict(_hostile_shard(10**6))
    tracemalloc.start()
    try:
        with pytest.raises(SoakReportError) as caught:
            merge_reports([report])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * 2**20, peak
    assert "1/1000000" in str(caught.value) and len(str(caught.value)) < 300


def test_soak_merge_of_a_billion_shards_is_one_line(tmp_path: Path) -> None:
    from kvmetrics.metrics import strict_json

    shard = tmp_path / "shard.json"
    shard.write_text(strict_json.dumps(_hostile_shard(10**9)))
    assert shard.stat().st_size < 600
    result = run_cli("soak-merge", str(shard))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "incomplete set of shards" in line


@pytest.mark.parametrize("item", ["{}", "[]", '{"a":1}', "[[]]"])
def test_json_that_would_amplify_in_memory_is_refused_cheaply(tmp_path: Path,
                                                              item: str) -> None:
    """Three bytes of ``{},`` are a 64-byte dict: 26 times the file in memory."""
    from kvmetrics.cli.common import read_json_file

    path = tmp_path / "amplify.json"
    path.write_text("[" + ",".join([item] * 1_000_000) + "]")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        data, problem = read_json_file(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data is None and problem is not None and "\n" not in problem
    assert "objects" in problem or "lists" in problem, problem
    assert peak < 3 * size + 2**20, (peak, size)


def test_report_of_an_amplifying_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text("[" + ",".join(["{}"] * 1_000_000) + "]")
    result = run_cli("report", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "run.json" in line


def test_ordinary_json_still_loads() -> None:
    from kvmetrics.metrics import strict_json

    rows = [{"step": i, "tokens": [i, i + 1, i * 1.5], "name": f"r{i}"} for i in range(20000)]
    assert strict_json.loads(strict_json.dumps({"rows": rows}))["rows"][-1]["step"] == 19999
    assert strict_json.loads("[{}]") == [{}]  # tiny files: under the floor, whatever shape


@pytest.mark.parametrize("value", [5, ["evict"], {"a": 1}, "x" * 70_000])
def test_the_recovery_setting_read_before_the_others_is_one_short_line(value: Any) -> None:
    """The scheduler class reads ``recovery`` first (it decides the class), so its check
    cannot wait for the settings' own."""
    from kvmetrics.protect.recovery import protect_decided

    line = _refused(partial(protect_decided, (), {"vllm_config": _config({"recovery": value})}))
    assert "recovery" in line.lower()


def test_null_in_additional_config_leaves_the_environment_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmetrics.protect.recovery import recovery_setting
    from kvmetrics.vllm.exporting import settings_for

    env = {"KVMETRICS_MODEL_NAME": "chat", "KVMETRICS_RECOVERY": "evict"}
    config = _config({"model_name": None, "recovery": None, "strict": None})
    assert settings_for(config, env=env).model_name == "chat"
    assert recovery_setting(config, env=env) == "evict"
    check_setting_keys(config)
