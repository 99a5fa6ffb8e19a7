"""What an engine says at start about kvmetrics, on vLLM's real scheduler in-process.

A metrics address that is not ``HOST:PORT`` stops the start with one line naming the
setting, the value and the form expected. One that is well formed but cannot be bound
(the port is taken) costs one error line naming the address and the reason: the
engine serves its requests anyway, and nothing announces the endpoint (no "serving
metrics on" line, no port file). Every engine also says once which vLLM scheduler
kvmetrics runs over and what vLLM's "degraded performance" warning means for it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.vllm import builder
from kvmetrics.lab.vllm.engine import VllmEngine
from kvmetrics.vllm.base_choice import VLLM_WARNING
from kvmetrics.vllm.exporting import LOGGER, ExportSettings, build_exporter

pytestmark = pytest.mark.vllm

PROMPT = list(range(1000, 1064))
CONFIG = SchedulerConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=8,
                         max_num_batched_tokens=256, max_model_len=512)
FORMAT = logging.Formatter("%(levelname)s %(message)s")


class _Lines(logging.Handler):
    """Every record of kvmetrics' vLLM logger, formatted with its traceback if any (the
    logger is a child of vLLM's, which does not propagate to the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(FORMAT.format(record))


@contextlib.contextmanager
def kvmetrics_log() -> Iterator[list[str]]:
    handler, logger = _Lines(), logging.getLogger(LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port that something else is listening on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def engine_with(settings: dict) -> VllmEngine:
    store = ExternalStoreIndex(16)
    return VllmEngine(CONFIG, SimulatedExecutor(FaultPlan(), store), store=store,
                      kvmetrics_settings=settings)


@pytest.mark.parametrize("value", [
    "http://127.0.0.1:9401",  # a URL where an address belongs
    "127.0.0.1",              # no port
    "0.0.0.0:94o1",           # a typo in the port
    "127.0.0.1:99999",        # a port out of range
    "a b:9401",               # not a host
])
def test_a_malformed_address_stops_the_start_with_one_line(
        value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMETRICS_METRICS_ADDR", value)
    with kvmetrics_log() as lines, pytest.raises(ValueError) as caught:
        engine_with({})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"kvmetrics: KVMETRICS_METRICS_ADDR={value!r} is not an "
                              "address to serve metrics on: expected HOST:PORT"), message
    assert "127.0.0.1:9401" in message.partition("expected")[2]  # an example of the form
    assert lines == []  # nothing else said, no traceback of kvmetrics' own


def test_the_additional_config_key_is_named_and_a_long_value_cut(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMETRICS_METRICS_ADDR", "127.0.0.1:0")  # overridden per engine
    value = "h" * 300 + ":x"
    with pytest.raises(ValueError) as caught:
        engine_with({"metrics_addr": value})
    message = str(caught.value)
    assert message.startswith("kvmetrics: additional_config.kvmetrics.metrics_addr="
                              f"{'h' * 80 + '...'!r} is not an address"), message
    assert len(message) < 300 and "\n" not in message


@pytest.mark.parametrize("value", ["127.0.0.1:0", "localhost:0", "[::1]:0", "off"])
def test_well_formed_addresses_are_accepted(value: str) -> None:
    engine = engine_with({"metrics_addr": value})
    engine.close()


def test_a_taken_port_costs_one_line_and_the_engine_serves_unobserved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port_file = tmp_path / "port"
    monkeypatch.setenv("KVMETRICS_METRICS_PORT_FILE", str(port_file))
    with taken_port() as port, kvmetrics_log() as lines:
        engine = engine_with({"metrics_addr": f"127.0.0.1:{port}"})
        try:
            assert engine.scheduler.kvmetrics_exporter.server is None
            engine.add_request(Request("r", ExplicitTokens(PROMPT), 4))
            engine.run()  # vLLM's scheduler runs the request to its end
            assert engine.scheduler.kvmetrics_pipeline is not None
        finally:
            engine.close()
    errors = [line for line in lines if line.startswith("ERROR")]
    assert errors == [f"ERROR kvmetrics: cannot serve metrics on 127.0.0.1:{port}: Address "
                      "already in use; this engine runs on without a kvmetrics endpoint "
                      "(free it, or set KVMETRICS_METRICS_ADDR to one it can bind)"], lines
    assert not any("Traceback" in line or "serving metrics on" in line for line in lines), \
        lines
    assert not port_file.exists()  # nothing points a scraper at the other process


def test_rank_ports_are_bound_and_a_taken_one_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Data-parallel rank r serves on PORT + r: the line names the port that was taken,
    and a rank whose port is free serves there and only then writes the port file."""
    port_file = tmp_path / "port"
    monkeypatch.setenv("KVMETRICS_METRICS_PORT_FILE", str(port_file))
    with taken_port() as port, kvmetrics_log() as lines:
        taken = build_exporter(ExportSettings(metrics_addr=f"127.0.0.1:{port - 1}",
                                              port_offset=1, serve="engine"))
        assert taken.server is None and not port_file.exists()
        assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in lines[-1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        served = build_exporter(ExportSettings(metrics_addr=f"127.0.0.1:{free - 2}",
                                               port_offset=2, serve="engine"))
        try:
            assert served.server is not None and served.server.port == free
            assert lines[-1] == ("INFO kvmetrics: serving metrics on "
                                 f"http://127.0.0.1:{free}/metrics")
            assert port_file.read_text() == f"{free}\n"
        finally:
            served.shutdown()
            taken.shutdown()


@pytest.mark.parametrize("decided", [True, False], ids=["async", "sync"])
def test_the_engine_says_which_scheduler_base_it_runs_over_and_why(decided: bool) -> None:
    cfg = SchedulerConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=8,
                          max_num_batched_tokens=256, max_model_len=512,
                          async_scheduling=decided)
    with kvmetrics_log() as lines:
        sched = builder.build_scheduler(cfg, scheduler_cls=builder.instrumented_cls(cfg),
                                        kvmetrics_settings={"export": False})
    try:
        assert isinstance(sched, AsyncScheduler) is decided
        said = [line for line in lines if "runs over vLLM's" in line]
        assert len(said) == 1, lines
        if decided:
            assert said[0].startswith("INFO kvmetrics: InstrumentedAsyncScheduler runs over "
                                      "vLLM's AsyncScheduler: vLLM decided async scheduling "
                                      "for this engine (scheduler_config.async_scheduling="
                                      "True)"), said
            assert said[0].endswith(f'"{VLLM_WARNING}" does not apply: this class keeps '
                                    "async scheduling"), said
        else:
            assert said[0].startswith("INFO kvmetrics: InstrumentedScheduler runs over "
                                      "vLLM's Scheduler: vLLM decided against async "
                                      "scheduling for this engine (scheduler_config."
                                      "async_scheduling=False)"), said
            assert said[0].endswith(f'"{VLLM_WARNING}" does not apply: vLLM runs its own '
                                    "Scheduler here too"), said
    finally:
        sched.shutdown()


def test_the_quoted_warning_is_vllms_own_text() -> None:
    """Quoted as vLLM writes it, so that grepping the engine's log for it finds both."""
    from vllm.config.scheduler import SchedulerConfig as VllmSchedulerConfig

    # The warning's string literals, joined as Python joins adjacent ones.
    text = "".join(re.findall(r'"([^"]*)"',
                              inspect.getsource(VllmSchedulerConfig.get_scheduler_cls)))
    assert VLLM_WARNING in text
