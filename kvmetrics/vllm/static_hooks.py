"""The hook table checked against a vLLM's classes, without building a scheduler.

At construction :func:`.hooks.check_hooks` checks the table on a live scheduler. A vLLM
build that is only a source tree, a wheel or a fork's branch cannot always build one
(no model, no C extensions), yet the question "which hook would break" can be answered
from its classes: each hooked method must exist with the expected leading parameters
(:func:`.hooks.signature_problem`, the same rule), and each attribute a hook reads must
be a class attribute, a property, or assigned as ``self.<name>`` somewhere in the owner's
module. ``scripts/check-vllm-release.sh`` prints the result for any build.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from kvmetrics.vllm import fingerprints, hooks, source_hashes


def owner_class(owner: str) -> type:
    module, _, name = source_hashes.OWNER_CLASSES[owner].partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type)
    return cls


def _assigned_on_self(cls: type, name: str) -> bool:
    """``self.<name> =`` (or an annotated one) in the module of ``cls`` or of a vLLM base."""
    pattern = re.compile(rb"self\.%s\s*(?::[^=\n]+)?=(?!=)" % re.escape(name.encode()))
    for base in cls.__mro__:
        path = source_hashes.module_file(base.__module__)
        if path is not None and pattern.search(path.read_bytes()):
            return True
    return False


def problems() -> dict[str, str]:
    """``{hook or attribute name: problem}`` for this vLLM's classes."""
    found: dict[str, str] = {}
    fields = hooks.output_fields()
    for hook in hooks.HOOKS:
        try:
            cls = owner_class(hook.owner)
        except (ImportError, AttributeError) as e:
            found[hook.name] = f"owner class missing ({e})"
            continue
        fn = getattr(cls, hook.method, None)
        if fn is None and hook.fed_by_output_field not in (None, *fields):
            continue  # an older vLLM without this path (hooks.py)
        problem = hooks.signature_problem(fn, hook, unbound=True)
        if problem is not None:
            found[hook.name] = problem
    for attribute in hooks.ATTRIBUTES:
        if attribute.owner == "kv_connector_output":
            present = hooks.resolve_attribute(None, attribute, fields) is not None
        else:
            cls = owner_class(attribute.owner)
            present = any(hasattr(cls, n) or _assigned_on_self(cls, n)
                          for n in attribute.names)
        if not present:
            found[attribute.name] = "missing (looked for " + ", ".join(attribute.names) + ")"
    return found


def print_problems() -> bool:
    """Print the hook table's state; True when nothing is broken."""
    found = problems()
    total = len(hooks.HOOKS) + len(hooks.ATTRIBUTES)
    if not found:
        print(f"hook table: all {total} hooks and attributes present, signatures as expected")
        return True
    print(f"hook table: {len(found)} of {total} broken (their families would be absent)")
    for name, problem in sorted(found.items()):
        print(f"  broken: {name}: {problem}")
    return False


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 all well, 2 a bad argument, else bit 1 fingerprints differ and bit
    4 hooks broken."""
    parser = argparse.ArgumentParser(
        prog="python -m kvmetrics.vllm.static_hooks",
        description="Check the hook table against the importable vLLM's classes.")
    parser.add_argument("--fingerprints-against", metavar="VERSION",
                        help="first print the fingerprint comparison (fingerprints.py "
                             "--against VERSION) in the same process")
    args = parser.parse_args(argv)
    status = 0
    if args.fingerprints_against is not None:
        differ = fingerprints.main(["--against", args.fingerprints_against])
        if differ == 2:
            return 2
        status |= 1 if differ else 0
    return status | (0 if print_problems() else 4)


if __name__ == "__main__":
    sys.exit(main())
