"""Judge one vLLM version's run of scripts/test-vllm-series.sh from pytest's JUnit files.

    vllm-series-compare.py VERSION MODE STOCK.xml PATCHED.xml REPRO.xml REPRODUCTION...

STOCK.xml: vLLM's tests on the release as shipped; PATCHED.xml: the tests of the
patched tree on the patched scheduler; REPRO.xml: only the reproductions (the tests
the series adds, named by its ``Reproduces:`` lines) of the patched tree, on the
release as shipped. Fails (exit 1) when a test passing on the release does not pass
patched, or a reproduction passes on the release or does not pass patched. Prints
the one-line summary, and each failure.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def outcomes(path: str) -> dict[str, str]:
    """Test id (``tests/v1/core/test_x.py::test_y[param]``) -> passed/failed/error/skipped."""
    found: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        name = case.get("name", "")
        file = module.replace(".", "/") + ".py" if module else "?"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                break
        # A test that fails and then errors in teardown is reported twice: keep the worst.
        if found.get(f"{file}::{name}", "passed") == "passed":
            found[f"{file}::{name}"] = outcome
    return found


def matches(test_id: str, reproduction: str) -> bool:
    return test_id == reproduction or test_id.startswith(reproduction + "[")


def counts(results: dict[str, str]) -> str:
    c = Counter(results.values())
    return (f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
            f"{c['skipped']} skipped")


def main(argv: list[str]) -> int:
    version, mode, stock_xml, patched_xml, repro_xml, *reproductions = argv
    stock, patched, repro = outcomes(stock_xml), outcomes(patched_xml), outcomes(repro_xml)
    problems: list[str] = []
    regressions = sorted(t for t, o in stock.items()
                         if o == "passed" and patched.get(t) != "passed")
    problems += [f"passes on {version}, {patched.get(t, 'missing')} patched: {t}"
                 for t in regressions]
    n_cases = 0
    for reproduction in reproductions:
        on_stock = {t: o for t, o in repro.items() if matches(t, reproduction)}
        on_patched = {t: o for t, o in patched.items() if matches(t, reproduction)}
        if not on_stock or not on_patched:
            problems.append(f"reproduction not run: {reproduction}")
            continue
        n_cases += len(on_patched)
        problems += [f"reproduction {o} on {version} (must fail): {t}"
                     for t, o in on_stock.items() if o not in ("failed", "error")]
        problems += [f"reproduction {o} patched (must pass): {t}"
                     for t, o in on_patched.items() if o != "passed"]
    fixed = sorted(t for t, o in patched.items() if o == "passed"
                   and stock.get(t) not in (None, "passed"))
    repro_ok = not any("reproduction" in p for p in problems)
    print(f"vLLM {version} ({mode}): stock {counts(stock)}; patched {counts(patched)}; "
          f"{len(regressions)} stock-passing tests not passing patched; "
          f"{len(reproductions)} reproductions ({n_cases} cases) "
          f"{'all' if repro_ok else 'NOT all'} failing on {version} and passing patched; "
          f"{len(fixed)} tests failing on {version} pass patched")
    for problem in problems:
        print(f"  FAIL {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
