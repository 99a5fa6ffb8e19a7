"""The torch runner against the tensor-less executor, and clean runs of the data plane.

Clean here means a correct recovery path in configurations where the findings
reproduced in ``test_kv_recovery.py`` cannot arise: every prompt has its own
suffix (so nobody reuses a same-step sharer's blocks), and under ``recompute``
with sync loads nobody is preempted or aborted before recomputing a failed block.
"""

from __future__ import annotations

import pytest
import torch

from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.kv.device import available_devices
from kvmetrics.lab.kv.harness import Engine, Trace, build_engine, drive, shared_prefix_jobs
from kvmetrics.metrics import catalogue as cat

DEVICES = available_devices()


def _run(runner: str = "torch", *, seed: int = 0, n: int = 24, abort_rate: float = 0.0,
         eos_rate: float = 0.0, fault_rate: float = 0.0, **kw) -> tuple[Engine, Trace]:
    jobs = shared_prefix_jobs(seed, n, spread=20, abort_rate=abort_rate, eos_rate=eos_rate,
                              n_prefixes=3, prefix_len=20)
    engine = build_engine(runner=runner, seed=seed, faults=FaultPlan(rate=fault_rate, seed=seed),
                          **kw)
    return engine, drive(engine, jobs)


def _totals(engine: Engine) -> dict[str, int]:
    """Counter totals of the events the scheduler handed out (runner events merged in)."""
    names = {cat.KV_VERIFIED_TOKENS.name: "verified",
             cat.KV_VERIFICATION_FAILED_BLOCKS.name: "failures",
             cat.PREEMPTIONS.name: "preemptions"}
    totals = dict.fromkeys(names.values(), 0)
    for events in engine.scheduler.drain_events():
        for inc in events.increments:
            if inc.spec.name in names:
                totals[names[inc.spec.name]] += int(inc.amount)
    return totals


# -- same decisions as the executor ---------------------------------------------------------


EQUIVALENCE = [
    dict(policy="recompute", load_mode="sync", fault_rate=0.3, num_gpu_blocks=24),
    dict(policy="recompute", load_mode="async", fault_rate=0.3, num_gpu_blocks=24,
         async_delay_steps=2),
    dict(policy="fail", load_mode="mixed", fault_rate=0.3, num_gpu_blocks=24, abort_rate=0.2),
    dict(policy="fail", load_mode="async", fault_rate=0.2, num_gpu_blocks=24,
         async_delay_steps=0, eos_rate=0.5, eos_probability=0.2),
    dict(policy="recompute", load_mode="mixed", fault_rate=0.25, num_gpu_blocks=24,
         store_blocks=32, abort_rate=0.1),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", EQUIVALENCE, ids=lambda c: f"{c['policy']}-{c['load_mode']}")
def test_same_schedule_and_outputs_as_simulated_executor(device: str, config: dict) -> None:
    engine, torch_trace = _run("torch", seed=3, device=device, **config)
    _, sim_trace = _run("simulated", seed=3, **config)
    assert torch_trace.schedule == sim_trace.schedule
    assert torch_trace.outputs == sim_trace.outputs
    stats = engine.runner.stats
    assert stats.loaded_blocks > 0 and stats.poisoned_blocks > 0 and stats.saved_blocks > 0


@pytest.mark.parametrize("mode", ["sampled", "off"])
def test_verify_mode_does_not_change_the_schedule(mode: str) -> None:
    config = dict(policy="recompute", load_mode="mixed", fault_rate=0.3, num_gpu_blocks=24)
    full, full_trace = _run(**config)
    other, other_trace = _run(verify=mode, verify_fraction=0.3, **config)
    assert other_trace == full_trace
    assert other.runner.stats.verified_reads < full.runner.stats.verified_reads
    if mode == "off":
        assert other.runner.stats.verified_reads == 0
    else:
        assert other.runner.stats.verified_reads > 0


# -- clean runs: zero findings ------------------------------------------------------------


CLEAN = {
    # No faults: preemption pressure and aborts in every load mode and policy.
    "nofault-sync-small-cache": dict(load_mode="sync", num_gpu_blocks=16, abort_rate=0.2),
    "nofault-async-small-cache": dict(load_mode="async", num_gpu_blocks=24, abort_rate=0.2,
                                      policy="fail"),
    "nofault-mixed-small-cache": dict(load_mode="mixed", num_gpu_blocks=16, abort_rate=0.2),
    # Faults under fail: failed blocks are evicted, so preemption and aborts are safe.
    "fail-sync": dict(policy="fail", load_mode="sync", fault_rate=0.3, num_gpu_blocks=20,
                      abort_rate=0.2),
    "fail-async": dict(policy="fail", load_mode="async", fault_rate=0.5, num_gpu_blocks=24,
                       abort_rate=0.2),
    "fail-mixed": dict(policy="fail", load_mode="mixed", fault_rate=0.3, num_gpu_blocks=20,
                       abort_rate=0.2),
    # Faults under recompute: async failures are never cached; sync ones are
    # recomputed by their owner before anyone else can read them, as long as the
    # owner is neither preempted nor aborted first (see test_kv_recovery.py).
    "recompute-async": dict(policy="recompute", load_mode="async", fault_rate=0.5,
                            num_gpu_blocks=24, abort_rate=0.2),
    # Two requests at a time never run out of blocks, yet the small cache keeps
    # evicting cached prefixes, so later requests load them from the store.
    "recompute-sync": dict(policy="recompute", load_mode="sync", fault_rate=0.3,
                           num_gpu_blocks=24, max_num_seqs=2),
    "recompute-mixed": dict(policy="recompute", load_mode="mixed", fault_rate=0.3,
                            num_gpu_blocks=24, max_num_seqs=2),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CLEAN))
def test_clean_run_has_zero_findings(device: str, name: str) -> None:
    config = CLEAN[name]
    engine, trace = _run(seed=11, device=device, strict=True, **config)
    stats = engine.runner.stats
    assert engine.runner.findings == [] and stats.findings == 0
    assert stats.verified_tokens > 0 and stats.loaded_blocks > 0
    if config.get("fault_rate"):
        assert stats.poisoned_blocks > 0
        if config["load_mode"] != "async":
            assert stats.discarded_reads > 0
    totals = _totals(engine)
    assert (totals["verified"], totals["failures"]) == (stats.verified_tokens, 0)
    if "small-cache" in name:
        assert totals["preemptions"] > 0
    if name.startswith("recompute-") and config["load_mode"] != "async":
        assert totals["preemptions"] == 0
    assert {reason for _, reason in trace.outputs.values()} <= {
        "stopped", "length", "aborted", "error"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_clean_run(device: str, dtype: str) -> None:
    engine, _ = _run(device=device, dtype=dtype, policy="fail", load_mode="mixed",
                     fault_rate=0.3, num_gpu_blocks=20, strict=True)
    assert engine.runner.cache.dtype == getattr(torch, dtype)
    assert engine.runner.findings == [] and engine.runner.stats.poisoned_blocks > 0


# -- determinism -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_gives_bit_identical_runs(device: str) -> None:
    config = dict(policy="recompute", load_mode="mixed", fault_rate=0.3, num_gpu_blocks=20,
                  abort_rate=0.2, eos_rate=0.5, eos_probability=0.1, device=device)
    first, first_trace = _run(seed=5, **config)
    second, second_trace = _run(seed=5, **config)
    assert first_trace == second_trace
    assert first.runner.kv_checksum() == second.runner.kv_checksum()
    assert torch.equal(first.runner.cache.data.isnan(), second.runner.cache.data.isnan())
    assert first.runner.findings == second.runner.findings
    assert first.runner.stats == second.runner.stats
    third, _ = _run(seed=6, **config)
    assert third.runner.kv_checksum() != first.runner.kv_checksum()


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_and_kv_do_not_depend_on_the_device(device: str) -> None:
    config = dict(policy="fail", load_mode="mixed", fault_rate=0.3, num_gpu_blocks=20)
    cpu, cpu_trace = _run(device="cpu", **config)
    other, other_trace = _run(device=device, **config)
    assert other_trace == cpu_trace
    assert other.runner.kv_checksum() == cpu.runner.kv_checksum()


# -- plumbing --------------------------------------------------------------------------------


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="verify mode"):
        build_engine(verify="most")
    with pytest.raises(ValueError, match="save_policy"):
        build_engine(save_policy="sometimes")
    with pytest.raises(ValueError, match="KV dtype"):
        build_engine(dtype="int8")


def test_no_connector_runs_without_store() -> None:
    engine, _ = _run(store_blocks=0, num_gpu_blocks=16, strict=True)
    assert engine.runner.host is None and engine.runner.stats.loaded_blocks == 0
    assert engine.runner.findings == [] and engine.runner.stats.verified_tokens > 0
    assert engine.runner.kv_checksum().endswith(":-")


def test_finished_requests_release_their_state() -> None:
    engine, _ = _run(abort_rate=0.3, num_gpu_blocks=16)
    engine.loop.step()  # delivers the last finished ids to the runner
    assert len(engine.runner.digests) == 0 and engine.runner._seeds == {}
    assert engine.runner._staged == {}
