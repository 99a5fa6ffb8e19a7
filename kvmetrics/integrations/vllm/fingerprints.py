"""Which vLLM kvmetrics was verified on, and whether the running one is the same code.

A version string says nothing about a nightly, a fork (vllm-ascend and others) or a
patched vLLM, so kvmetrics carries, per verified version, a fingerprint (a hash of
``inspect.getsource``) of every vLLM function and class whose internals its hooks, its
gauges or its protective mode depend on (:data:`TARGETS`), in ``verified_vllm.json``
next to this module. The file is written by ``python -m
kvmetrics.integrations.vllm.fingerprints --record`` (never by hand) after the version's
tests pass; ``--diff`` prints what differs from the verified versions.

At construction the instrumented scheduler calls :func:`check`: on a vLLM whose version
is not in the file, or whose fingerprints differ from it, it logs one warning naming the
differing targets, and the protective recovery refuses to start unless
``KVMETRICS_ALLOW_UNVERIFIED_VLLM=1`` (``protect_allowed``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("verified_vllm.json")
#: The environment variable that lets the protective recovery run on unverified code.
ALLOW_UNVERIFIED = "KVMETRICS_ALLOW_UNVERIFIED_VLLM"

_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
#: What the hooks, the gauges and the protective mode read or override, as
#: ``module:qualified.name``. Whole classes where kvmetrics reads their fields.
TARGETS: tuple[str, ...] = (
    f"{_SCHED}.__init__",  # the queues the gauges and self-checks count
    f"{_SCHED}.schedule",
    f"{_SCHED}.update_from_output",
    f"{_SCHED}._preempt_request",
    f"{_SCHED}._free_request",
    f"{_SCHED}._handle_invalid_blocks",
    f"{_SCHED}._update_requests_with_invalid_blocks",
    f"{_SCHED}._handle_failed_recving",
    f"{_SCHED}._update_waiting_for_remote_kv",
    f"{_SCHED}._handle_blocked_waiting_request",
    f"{_SCHED}._reserve_parked",  # 0.34: a parked async load's reservation
    f"{_SCHED}._unreserve_parked",  # the protective mode drops an emptied one
    f"{_SCHED}.get_request_counts",
    f"{_SCHED}.get_kv_cache_usage",
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.record_prefix_cache_stats",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.evict_blocks",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.reset_prefix_cache",
    "vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block",
    "vllm.v1.outputs:KVConnectorOutput",
    "vllm.v1.request:RequestStatus",
)


def fingerprint(target: str) -> str:
    """The first 16 hex digits of sha256 of the target's source; ``missing`` if it does
    not exist in this vLLM, ``no-source`` if Python cannot show its source."""
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return "missing"
    obj = getattr(obj, "fget", obj)  # a property: its getter
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return "no-source"
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def current() -> dict[str, str]:
    return {target: fingerprint(target) for target in TARGETS}


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def load(path: Path = DATA) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


@dataclass(frozen=True)
class Verification:
    """How the running vLLM compares with what kvmetrics was verified on."""

    version: str
    #: The version is in the file and every fingerprint equals its record.
    verified: bool
    #: Targets whose fingerprint differs from the record of the same version (or, for an
    #: unknown version, from the closest verified one).
    differing: tuple[str, ...] = ()
    #: The verified version compared with (None: the file lists none).
    compared_with: str | None = None
    #: The protective recovery was verified on that version too.
    protect_verified: bool = False
    verified_versions: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        if self.verified:
            return f"vLLM {self.version} (verified)"
        known = ", ".join(self.verified_versions) or "none"
        if self.compared_with is None:
            return f"vLLM {self.version} is not a verified version (verified: {known})"
        which = ", ".join(self.differing) or "none"
        where = ("" if self.compared_with == self.version
                 else f" is not a verified version (verified: {known}); against "
                      f"{self.compared_with}")
        return f"vLLM {self.version}{where}: fingerprints differ in {which}"


def check(fingerprints: dict[str, str] | None = None, version: str | None = None,
          data: dict[str, Any] | None = None) -> Verification:
    """Compare the running vLLM (or the given fingerprints) with the verified records."""
    found = current() if fingerprints is None else fingerprints
    version = vllm_version() if version is None else version
    records = load() if data is None else data
    versions = tuple(records)
    if not records:
        return Verification(version, False, verified_versions=versions)
    if version in records:
        base = version
    else:  # the closest verified version: fewest differing fingerprints
        base = min(records, key=lambda v: sum(
            records[v]["fingerprints"].get(t) != f for t, f in found.items()))
    record = records[base]
    differing = tuple(t for t, f in found.items() if record["fingerprints"].get(t) != f)
    return Verification(version, base == version and not differing, differing, base,
                        bool(record.get("protect_verified")), versions)


def check_safely() -> Verification:
    """:func:`check`, never raising: a vLLM kvmetrics cannot fingerprint is unverified."""
    try:
        return check()
    except Exception as e:  # noqa: BLE001 - observing must never stop the engine
        return Verification("unknown", False, (f"fingerprinting failed: {e}",))


def protect_allowed(result: Verification, env: dict[str, str] | None = None) -> str | None:
    """Why the protective recovery must not run here (None: it may)."""
    env = dict(os.environ) if env is None else env
    if env.get(ALLOW_UNVERIFIED, "").strip() == "1":
        return None
    if result.verified and result.protect_verified:
        return None
    if result.verified:
        reason = f"vLLM {result.version} is verified for the metrics, not for the fix"
    else:
        reason = result.summary()
    return (f"KVMETRICS_RECOVERY=evict refused: {reason} "
            f"(set {ALLOW_UNVERIFIED}=1 to run it anyway, knowingly)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmetrics.integrations.vllm.fingerprints",
        description="Record or compare the fingerprints of the installed vLLM.")
    parser.add_argument("--record", action="store_true",
                        help="write this vLLM's fingerprints into verified_vllm.json")
    parser.add_argument("--protect-verified", action="store_true",
                        help="with --record: the protective recovery was verified too")
    parser.add_argument("--data", type=Path, default=DATA, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    found, version = current(), vllm_version()
    if args.record:
        records = load(args.data)
        records[version] = {"protect_verified": args.protect_verified,
                            "fingerprints": found}
        ordered = dict(sorted(records.items(),
                              key=lambda kv: tuple(int(p) for p in kv[0].split(".")
                                                   if p.isdigit())))
        args.data.write_text(json.dumps(ordered, indent=2) + "\n", encoding="utf-8")
        print(f"recorded vLLM {version} ({len(found)} fingerprints) in {args.data}")
        return 0
    result = check(found, version, load(args.data))
    print(result.summary())
    for target in result.differing:
        print(f"  differs: {target}")
    return 0 if result.verified else 1


if __name__ == "__main__":
    sys.exit(main())
