"""Which vLLM kvmetrics was verified on, and whether the running one is the same code.

A version string says nothing about a nightly, a fork (vllm-ascend and others) or a
patched vLLM, so kvmetrics carries, per verified version, a normalised source hash of
every function, method and class of every vLLM module whose code can change a kvmetrics
figure: the set is derived from the hook table and the imports, not listed by hand
(:mod:`.source_hashes` says how). The records are in ``verified_vllm.json`` next to this
module, written by ``python -m kvmetrics.vllm.fingerprints --record`` (never
by hand) after the version's tests pass; without ``--record`` it prints what differs.

At construction the instrumented scheduler calls :func:`check`: on a vLLM whose version
is not in the file, or whose code differs from its record, it logs one warning naming the
first differing functions and their count, ``kvmetrics_build_info`` carries
``vllm_verified="false"`` (the alert ``KVMetricsVLLMUnverified`` reads it), and the
protective recovery refuses to start unless ``KVMETRICS_ALLOW_UNVERIFIED_VLLM=1``
(``protect_allowed``). The protective recovery has no narrower list of its own: it
needs the whole derived set equal to a record marked ``protect_verified``, a superset of
the methods it overrides and of the helpers they call.

Cost at construction, measured on 0.28, 0.32, 0.33 and 0.34 (five runs each, a shared
2-core machine, vLLM's modules already imported): 17-45 ms to derive the module set (20
modules, a regular-expression scan of their imports) and compare the sha256 of their
files' bytes with the record. A module whose bytes differ is parsed and hashed entry by
entry, 10-100 ms more per module (the scheduler's, 3800 lines, is the largest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmetrics.vllm import source_hashes

DATA = Path(__file__).with_name("verified_vllm.json")
#: The environment variable that lets the protective recovery run on unverified code.
ALLOW_UNVERIFIED = "KVMETRICS_ALLOW_UNVERIFIED_VLLM"
#: How many differing names the log line and the build info label show (then a count).
NAMES_SHOWN = 8


def current_files() -> dict[str, str]:
    """``{module: file digest}`` for the derived module set of the running vLLM."""
    return {m: source_hashes.file_digest(m) for m in source_hashes.covered_modules()}


def record_of_running() -> dict[str, Any]:
    """The running vLLM's record: per module, its file digest and entry hashes."""
    return {m: {"file": digest, "entries": source_hashes.hashes_of(m)}
            for m, digest in current_files().items()}


def differing_entries(record: dict[str, Any], files: dict[str, str]) -> tuple[str, ...]:
    """``module:qualname`` of every entry that differs between a version's record and the
    running vLLM (present in one only, or another hash). Modules with equal bytes are not
    parsed."""
    modules = record.get("modules", {})
    differing: list[str] = []
    for module in sorted(set(modules) | set(files)):
        recorded = modules.get(module, {})
        if recorded.get("file") == files.get(module):
            continue
        now = source_hashes.hashes_of(module) if module in files else {}
        before = recorded.get("entries", {})
        differing += [f"{module}:{q}" for q in sorted(set(now) | set(before))
                      if now.get(q) != before.get(q)]
    return tuple(differing)


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def load(path: Path = DATA) -> dict[str, Any]:
    try:
        recorded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return recorded
    except (OSError, ValueError):
        return {}


def _shown(names: tuple[str, ...], short: bool) -> str:
    shown = [n.partition(":")[2] if short else n for n in names[:NAMES_SHOWN]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" (+{more} more)" if more else "")


@dataclass(frozen=True)
class Verification:
    """How the running vLLM compares with what kvmetrics was verified on."""

    version: str
    #: The version is in the file and every entry of the derived set equals its record.
    verified: bool
    #: Entries (``module:qualname``) that differ from the record of the same version (or,
    #: for an unknown version, of the closest verified one).
    differing: tuple[str, ...] = ()
    #: The verified version compared with (None: the file lists none).
    compared_with: str | None = None
    #: The protective recovery was verified on that version too.
    protect_verified: bool = False
    verified_versions: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        """One line, of bounded length: the first differing names and their count."""
        if self.verified:
            return f"vLLM {self.version} (verified)"
        known = ", ".join(self.verified_versions) or "none"
        if self.compared_with is None:
            return f"vLLM {self.version} is not a verified version (verified: {known})"
        which = _shown(self.differing, short=False) or "none"
        where = ("" if self.compared_with == self.version
                 else f" is not a verified version (verified: {known}); against "
                      f"{self.compared_with}")
        return (f"vLLM {self.version}{where}: fingerprints differ in "
                f"{len(self.differing)} functions: {which}")

    def differ_label(self) -> str:
        """The build info's ``vllm_fingerprints_differ``: qualified names, bounded."""
        return _shown(self.differing, short=True)


def check(files: dict[str, str] | None = None, version: str | None = None,
          data: dict[str, Any] | None = None, against: str | None = None) -> Verification:
    """Compare the running vLLM (``files``: its module file digests) with the verified
    records: its own version's, else ``against``, else the closest (fewest differences)."""
    found = current_files() if files is None else files
    version = vllm_version() if version is None else version
    records = load() if data is None else data
    versions = tuple(records)
    if not records:
        return Verification(version, False, verified_versions=versions)
    if version in records:
        base = version
    elif against in records:
        base = str(against)
    else:
        base = min(records, key=lambda v: len(differing_entries(records[v], found)))
    record = records[base]
    differing = differing_entries(record, found)
    # Only a JSON true: the string "false" is true to bool(), and a record edited by
    # hand must not turn the protective recovery on.
    return Verification(version, base == version and not differing, differing, base,
                        record.get("protect_verified") is True, versions)


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


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmetrics.vllm.fingerprints",
        description="Record or compare the fingerprints of the installed vLLM.")
    parser.add_argument("--record", action="store_true",
                        help="write this vLLM's fingerprints into verified_vllm.json")
    parser.add_argument("--protect-verified", action="store_true",
                        help="with --record: the protective recovery was verified too")
    parser.add_argument("--against", metavar="VERSION",
                        help="for a version not in the record: compare with this verified "
                             "version ('newest': the newest one) instead of the closest")
    parser.add_argument("--data", type=Path, default=DATA, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    version = vllm_version()
    records = load(args.data)
    if args.record:
        found = record_of_running()
        records[version] = {"protect_verified": args.protect_verified, "modules": found}
        ordered = dict(sorted(records.items(), key=lambda kv: _version_key(kv[0])))
        args.data.write_text(json.dumps(ordered, indent=1, sort_keys=True) + "\n",
                             encoding="utf-8")
        count = sum(len(m["entries"]) for m in found.values())
        print(f"recorded vLLM {version} ({len(found)} modules, {count} fingerprints) "
              f"in {args.data}")
        return 0
    against = args.against
    if against == "newest" and records:
        against = max(records, key=_version_key)
    if against is not None and against not in records:
        print(f"fingerprints: --against {against}: not a verified version "
              f"({', '.join(records) or 'none'})", file=sys.stderr)
        return 2
    result = check(None, version, records, against)
    print(result.summary())
    for target in result.differing:
        print(f"  differs: {target}")
    return 0 if result.verified else 1


if __name__ == "__main__":
    sys.exit(main())
