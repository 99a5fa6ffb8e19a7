"""scripts/gpu-check.sh without a GPU, and the report it writes from its stages' parts.

The GPU figures themselves need a CUDA device; here the script must refuse in one
line, the report must flag every way a stage can end, and the verifier stage's
own pass/fail logic must hold on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu_check import stage_verify
from benchmarks.gpu_report import StageStatus, build_result, main, parse_status, summary

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_REHEARSE")}
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "figures.json")],
                          capture_output=True, text=True, timeout=60,
                          env={**base, "PYTHON": sys.executable, **env})


def test_script_refuses_in_one_line_without_cuda(tmp_path: Path) -> None:
    # No visible device, also on a machine that has one.
    done = _script(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 3
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith("gpu-check: no CUDA device visible (torch ")
    assert not (tmp_path / "figures.json").exists()


def test_script_refuses_an_unknown_rehearsal_device(tmp_path: Path) -> None:
    done = _script(tmp_path, GPU_CHECK_REHEARSE="tpu")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        "gpu-check: GPU_CHECK_REHEARSE must be cpu or unset, got 'tpu'"]


FAKE_PARTS = {
    "preflight": {"ok": True, "device_type": "cuda", "device": "NVIDIA H200",
                  "capability": "9.0", "memory_gib": 139.8, "torch": "2.9.0", "cuda": "12.8"},
    "verify": {"ok": False, "clean": {"findings": 2, "verified_tokens": 900},
               "broken_rollback": {"findings": 3, "first": "step 3: ..."}},
    "bench-load": None,
    "bench-verify": {"ok": False, "error": "RuntimeError: CUDA out of memory"},
    "load": None,
}
FAKE_STATUS = ("preflight 0 2.5 30\nverify 1 9.0 80\nbench-load 124 140.1 140\n"
               "bench-verify 1 3.0 110\nload 139 1.0 80\n")


def test_report_flags_every_way_a_stage_can_end() -> None:
    result = build_result(parse_status(FAKE_STATUS), FAKE_PARTS)
    verdicts = {stage: s["verdict"] for stage, s in result["stages"].items()}
    assert verdicts == {"preflight": "passed", "verify": "failed", "bench-load": "timed out",
                        "bench-verify": "error", "load": "crashed"}
    assert result["ok"] is False and result["rehearsal"] is False
    assert result["stages"]["bench-load"]["limit_s"] == 140
    text = summary(result)
    assert text.splitlines()[0] == "gpu-check: NOT ALL STAGES PASSED"
    assert "REHEARSAL" not in text
    assert "  NVIDIA H200 (compute 9.0, 139.8 GiB), torch 2.9.0, CUDA 12.8" in text
    assert "  correct recovery: 2 findings over 900 verified tokens" in text
    assert any(line.startswith("bench-verify  error") and line.endswith(
        ": RuntimeError: CUDA out of memory") for line in text.splitlines())


def test_report_writes_one_json_file_and_exits_by_the_verdict(tmp_path: Path,
                                                              capsys) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "status.tsv").write_text("preflight 0 1.0 30\n")
    (parts / "preflight.json").write_text(json.dumps({"ok": True, "device_type": "cpu",
                                                      "torch": "2.13.0"}))
    out = tmp_path / "out" / "gpu-check.json"
    assert main([str(parts), str(out)]) == 0
    assert [p.name for p in out.parent.iterdir()] == ["gpu-check.json"]
    written = json.loads(out.read_text())
    assert written["ok"] is True and written["rehearsal"] is True
    assert written["stages"]["preflight"]["verdict"] == "passed"
    printed = capsys.readouterr().out
    assert "REHEARSAL: not run on a CUDA device" in printed
    (parts / "preflight.json").write_text("{half a file")
    assert main([str(parts), str(out)]) == 1
    assert json.loads(out.read_text())["stages"]["preflight"]["verdict"] == "crashed"
    assert StageStatus("x", 0, 1.0, 2) == parse_status("x 0 1.0 2")[0]


def test_verify_stage_passes_a_correct_recovery_and_catches_a_skipped_rollback() -> None:
    result = stage_verify("cpu")
    assert result["ok"] is True
    assert result["clean"]["findings"] == 0 and result["clean"]["loaded_blocks"] > 0
    assert result["broken_rollback"]["findings"] > 0
    assert "request 'A' read bad KV" in result["broken_rollback"]["first"]
