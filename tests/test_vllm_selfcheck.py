"""The request gauges are vLLM's own counts, and the self-check notices kvmetrics' drift.

vLLM 0.34 added ``--max-num-inflight-kv-loads`` and a third queue of waiting requests
(``async_kv_waiting``): requests whose KV may load asynchronously wait there while the
cap is reached. kvmetrics used to count waiting requests from the two queues it knew,
and exported ``waiting 0`` where vLLM counted 4. Here a scripted connector offers every
request an async load, the cap (where this vLLM has it) is 1, and at every step the
exported gauges must add up to vLLM's ``get_request_counts()``; the self-check must
stay quiet. With the old derivation put back, on a vLLM with the cap, it must fire.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import pytest
from vllm.config import SchedulerConfig
from vllm.v1.request import RequestStatus

from kvmetrics.lab.vllm import builder, canary_bench
from kvmetrics.metrics import catalogue as cat
from kvmetrics.vllm import selfcheck

pytestmark = pytest.mark.vllm

#: Whether this vLLM has the inflight-load cap (0.34 on).
HAS_CAP = "max_num_inflight_kv_loads" in {f.name for f in dataclasses.fields(SchedulerConfig)}
INSTRUMENTED = canary_bench.Target(builder.INSTRUMENTED, builder.INSTRUMENTED_ASYNC,
                                   (("export", False),))
#: Enough requests, each long enough, that the cap holds requests back for many steps.
REQUESTS = 12


def run_capped(steps: int = 80) -> tuple[list[tuple[Any, ...]], dict[str, float], int]:
    """Requests offered async loads under a cap of 1; per step (exported gauges, vLLM's
    counts), the self-check failures by check, and the most requests seen in 0.34's
    ``async_kv_waiting``."""
    options = {"max_num_inflight_kv_loads": 1} if HAS_CAP else None
    with canary_bench.on_target(INSTRUMENTED):
        bench = canary_bench.bench(num_gpu_blocks=160, scheduler_options=options)
    sched = bench.sched
    for i in range(REQUESTS):
        bench.add(f"r{i}", canary_bench.prompt(1000 * (i + 1), 64),
                  offer=48, load_async=True, max_tokens=16)
    rows: list[tuple[Any, ...]] = []
    failures: dict[str, float] = {}
    most_capped = 0
    for _ in range(steps):
        if not sched.requests:
            break
        out = sched.schedule()
        arrived = {rid for rid, r in sched.requests.items()
                   if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
        bench.update(bench.execute(out), finished_recving=arrived)
        capped = len(getattr(sched, "async_kv_waiting", ()))
        most_capped = max(most_capped, capped)
        (events,) = sched.drain_events()
        g = events.gauges
        rows.append(((g.running, g.waiting + g.waiting_for_remote_kv), sched.get_request_counts(),
                     g.waiting_for_remote_kv, capped))
        for inc in events.increments:
            if inc.spec is cat.SELF_CHECK_FAILURES:
                failures[inc.label_values[0]] = failures.get(inc.label_values[0], 0) + inc.amount
    assert not sched.requests, "the requests did not finish"
    return rows, failures, most_capped


def test_the_waiting_gauges_are_vllms_request_counts_at_every_step() -> None:
    rows, failures, most_capped = run_capped()
    for step, (ours, vllms, *_) in enumerate(rows, 1):
        assert ours == tuple(vllms), f"step {step}: kvmetrics {ours}, vLLM {vllms}"
    assert any(remote for *_, remote, _ in rows), "no request ever waited for remote KV"
    if HAS_CAP:  # the cap held requests back in the third queue at some step
        assert most_capped >= REQUESTS - 2
    assert failures == {}


def test_the_old_derivation_trips_the_self_check(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """kvmetrics' derivation before vLLM 0.34: ``waiting`` + ``kv_holding_waiting``."""
    monkeypatch.setattr(selfcheck, "EXTRA_WAITING_QUEUES", ())
    with caplog.at_level(logging.WARNING, logger="kvmetrics"):
        rows, failures, _ = run_capped()
    lines = [r.getMessage() for r in caplog.records if "self-check" in r.getMessage()]
    if not HAS_CAP:
        # Up to 0.33 there is no third queue: the old derivation is right there.
        assert failures == {} and lines == []
        return
    # Checked at every step, not a sample: each step with a request parked in the queue
    # the old derivation misses counts once.
    parked_steps = sum(1 for *_, capped in rows if capped)
    assert set(failures) == {"requests_waiting"} and failures["requests_waiting"] == parked_steps
    # Logged once, with both values, however often it failed.
    assert len(lines) == 1, lines
    found = re.search(r"requests_waiting failed: kvmetrics derives (\d+) from vLLM's "
                      r"internals, vLLM itself says (\d+)", lines[0])
    assert found and int(found[1]) < int(found[2]), lines[0]
