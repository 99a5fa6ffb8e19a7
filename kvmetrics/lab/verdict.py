"""What a run's figures add up to, in words a newcomer reads without the docs.

The terminal summary and the HTML report both end in a verdict and repeat the faults
the run injected and the recovery it ran, so that a figure such as "1.4% failed" is
read next to "2.0% injected", and "960 rolled back" next to why more was recomputed.
Everything here is read from the run document (the summary plus ``config``); a field
that is absent (a summary without its configuration) leaves its sentence out rather
than guess it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PASS, FAIL, NOT_VERIFIED = "PASS", "FAIL", "NOT VERIFIED"

#: What each ``--policy`` does to a request whose KV load failed.
POLICY_WORDS = {
    "recompute": "a request whose load failed computes the lost blocks again",
    "fail": "a request whose load failed ends with an error",
}
#: What each ``--recovery`` runs.
RECOVERY_WORDS = {
    "vllm": "vLLM's own recovery path, its known defects included",
    "evict": "kvmetrics' complete fix of vLLM's recovery path",
}


@dataclass(frozen=True)
class Verdict:
    """PASS, FAIL or NOT VERIFIED, and why, in one sentence."""

    status: str
    reason: str

    @property
    def line(self) -> str:
        """The verdict as the terminal prints it (ASCII, so any terminal shows it)."""
        return f"verdict: {self.status} - {self.reason}"


def _plural(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def _counter_trouble(document: dict[str, Any]) -> str:
    """The guard's and the invariants' complaints, in words ("" when none)."""
    parts = []
    if document["invariant_violations"]:
        parts.append(_plural(document["invariant_violations"], "invariant violation",
                             "invariant violations"))
    if document["guard_rejected_increments"]:
        parts.append(_plural(document["guard_rejected_increments"], "guard rejection",
                             "guard rejections"))
    return " and ".join(parts)


def _partial(document: dict[str, Any]) -> str:
    """Why the figures cover only part of the workload ("" for a run that finished)."""
    if document.get("interrupted"):
        return f"; a partial run: interrupted by {document['interrupted']}"
    for key in ("stalled", "stopped"):
        if document.get(key):
            return f"; a partial run: {document[key]}"
    return ""


def verdict(document: dict[str, Any]) -> Verdict:
    """FAIL when a request read stale KV, or when the counters broke an invariant or
    were refused by the guard under the unified accounting (``--accounting historical``
    exists to produce those, so there they are noted, not failed); NOT VERIFIED when no
    read was checked; PASS otherwise."""
    config = document.get("config") or {}
    checked = document["verification"]
    stale, verified = checked["failed_blocks"], checked["verified_tokens"]
    trouble = _counter_trouble(document)
    expected = config.get("accounting") == "historical"
    if stale:
        readers = (document.get("findings") or {}).get("requests")
        by = f" by {_plural(readers, 'request', 'requests')}" if readers else ""
        status = FAIL
        reason = (f"{_plural(stale, 'stale KV block read', 'stale KV block reads')}{by}: "
                  "KV that differs from a clean computation was read")
    elif trouble and not expected:
        status, reason = FAIL, f"no request read stale KV, but the counters had {trouble}"
        trouble = ""
    elif not verified:
        status = NOT_VERIFIED
        reason = ("--verify off: stale KV reads cannot be seen" if config.get("verify") == "off"
                  else "no KV read was verified")
    else:
        sample = ", a sample of requests" if config.get("verify") == "sampled" else ""
        status = PASS
        reason = f"no request read stale KV ({verified:,} tokens verified{sample})"
    if trouble:
        reason += (f"; {trouble}, expected under --accounting historical" if expected
                   else f"; the counters also had {trouble}")
    return Verdict(status, reason + _partial(document))


def _rate(config: dict[str, Any]) -> float | None:
    rate = config.get("fault_rate")
    if isinstance(rate, int | float) and not isinstance(rate, bool):
        return float(rate)
    return None


def faults_text(config: dict[str, Any]) -> str:
    """What the run was told to fail: the plan's rate, per loaded block."""
    if config.get("fault_plan"):
        return (f"as --fault-plan {config['fault_plan']} lists them (its own rate and "
                "failures; --fault-rate does not apply)")
    rate = _rate(config)
    if rate:
        return f"each loaded KV block fails with probability {rate:.1%} (--fault-rate {rate:g})"
    return "none (--fault-rate 0)"


def injected_rate(config: dict[str, Any]) -> str:
    """The injected rate, short, to stand next to the measured share of failed loads."""
    if config.get("fault_plan"):
        return "injected: the fault plan's"
    rate = _rate(config)
    return f"injected rate {rate:.1%}" if rate else "none injected"


def policy_text(config: dict[str, Any]) -> str:
    """The failure policy the run ran, and what it does."""
    policy: Any = config.get("policy")
    return f"--policy {policy}: {POLICY_WORDS.get(policy, 'an unknown policy')}"


def recovery_text(config: dict[str, Any]) -> str:
    """The recovery path the run ran, and what it is."""
    recovery: Any = config.get("recovery")
    return f"--recovery {recovery}: {RECOVERY_WORDS.get(recovery, 'an unknown recovery')}"


def recompute_note(document: dict[str, Any]) -> str:
    """Why more tokens were recomputed after failed loads than were rolled back ("" when
    they were not): the two count different things, and a reader comparing them should
    not take the difference for an error."""
    rolled = document["rolled_back_tokens"]
    again = document["recomputed_tokens"]["kv_load_failure"]
    if again <= rolled:
        return ""
    return (f"{again:,} tokens recomputed after failed loads, more than the {rolled:,} rolled "
            "back: a failed step's own tokens are discarded and computed again without a "
            "rollback, and a request preempted before it caught up computes them once more")
