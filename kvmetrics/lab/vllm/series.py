"""The patch series of docs/vllm-patches/: which patch fixes which defect, where its
reproduction is, and the series for a given vLLM version.

The series is written against vLLM 0.34.0 (``docs/vllm-patches/000N-*.patch``, in
``git format-patch`` form, each with its PR description ``000N-*.md``); the backport
``docs/vllm-patches/0.33.0/`` applies to 0.33.0 and to 0.32.0. Each patch adds its
reproductions to vLLM's own test files and names them in ``Reproduces:`` lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PATCHES = Path(__file__).resolve().parents[3] / "docs" / "vllm-patches"
UNIT = "tests/v1/kv_connector/unit"


@dataclass(frozen=True)
class Fix:
    #: File name of the patch (the same in every version's series).
    patch: str
    #: The vLLM test the patch adds that fails on an affected vLLM (a pytest id).
    reproduction: str


FIXES: dict[str, Fix] = {
    "recompute-keeps-failed-block": Fix(
        "0001-recompute-evict-and-recache.patch",
        f"{UNIT}/test_invalid_blocks_correctness.py::"
        "test_sync_recompute_invalid_blocks_evicted_until_recomputed"),
    "chunked-recompute-sharer": Fix(
        "0002-shared-failed-blocks.patch",
        f"{UNIT}/test_kv_load_failure_recovery.py::"
        "test_sync_load_failure_shared_block_recomputed_in_chunks"),
    "fail-sharer-blocks-hashed": Fix(
        "0002-shared-failed-blocks.patch",
        f"{UNIT}/test_invalid_blocks_correctness.py::test_sync_fail_sharer_blocks_evicted"),
    "async-load-stall": Fix(
        "0004-async-load-own-reservation.patch",
        f"{UNIT}/test_kv_load_failure_recovery.py::"
        "test_async_load_failure_retry_not_refused_by_own_reservation"),
    "aborted-owner-keeps-failed-block": Fix(
        "0003-aborted-in-flight.patch",
        f"{UNIT}/test_invalid_blocks_correctness.py::"
        "test_sync_load_failure_of_request_aborted_during_step"),
    "async-rollback-in-flight": Fix(
        "0002-shared-failed-blocks.patch",
        f"{UNIT}/test_kv_load_failure_recovery.py::"
        "test_async_scheduling_sync_load_failure_drops_in_flight_output"),
    "async-sharer-in-flight": Fix(
        "0002-shared-failed-blocks.patch",
        f"{UNIT}/test_kv_load_failure_recovery.py::"
        "test_async_scheduling_sharer_admitted_during_failed_load"),
}


def series_dir(vllm_version: str) -> Path:
    """Where the series for this vLLM version is: 0.34 the series itself, older
    minors the 0.33.0 backport (which applies to 0.32.0 as well)."""
    if vllm_version.startswith("0.34."):
        return PATCHES
    return PATCHES / "0.33.0"


#: Pull requests of docs/vllm-patches/ that fix none of the defects: each applies to
#: the release by itself and is reviewed alone (it touches the recovery functions the
#: fixes rewrite, so it is not stacked on them). scripts/test-vllm-series.sh checks
#: them alone; :func:`series` leaves them out.
SEPARATE = ("0005-kv-load-failure-metrics.patch",)


def series(vllm_version: str) -> list[Path]:
    """The patch files of the fix series for this vLLM version, in the order they
    apply (the separate pull requests are not part of it)."""
    return sorted(patch for patch in
                  series_dir(vllm_version).glob("[0-9][0-9][0-9][0-9]-*.patch")
                  if patch.name not in SEPARATE)


def reproduction(defect_id: str, vllm_version: str = "0.34.0") -> str:
    """The reproduction of ``defect_id`` as the series adds it to vLLM's test file:
    the test function (decorators included) and the module-level helpers that this
    patch or an earlier one of the series adds and that it calls."""
    fix = FIXES[defect_id]
    path, name = fix.reproduction.split("::")
    blocks: list[str] = []
    for patch in series(vllm_version):
        blocks += _top_level_blocks(_added_lines(patch.read_text(encoding="utf-8"), path))
        if patch.name == fix.patch:
            break
    (test,) = [b for b in blocks if _defines(b, name)]
    helpers = [b for b in blocks if b is not test and any(
        f"{helper}(" in test for helper in _names(b))]
    return "\n\n\n".join([*helpers, test]) + "\n"


def _added_lines(patch: str, path: str) -> list[str]:
    lines: list[str] = []
    in_file = False
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            in_file = line.endswith(f" b/{path}")
        elif in_file and line.startswith("+") and not line.startswith("+++"):
            lines.append(line[1:])
        elif in_file and not line.startswith(("-", "@@", "index ", "---")):
            lines.append("")  # a context line ends a run of added ones
    return lines


def _top_level_blocks(lines: list[str]) -> list[str]:
    """Top-level definitions (with their decorators) among the added lines."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in lines:
        if line.startswith(("def ", "@")):
            if current is None or not current[-1].startswith("@"):
                current = []
                blocks.append(current)
            current.append(line)
        elif current is not None and (line.startswith((" ", ")")) or not line):
            current.append(line)
        else:
            current = None
    return ["\n".join(b).strip("\n") for b in blocks]


def _defines(block: str, name: str) -> bool:
    return f"\ndef {name}(" in f"\n{block}"


def _names(block: str) -> list[str]:
    return [line[4:].split("(", 1)[0] for line in block.splitlines() if line.startswith("def ")]
