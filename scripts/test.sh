#!/usr/bin/env bash
# Install everything the tests need (project, test tools, light vLLM, prometheus)
# and run the whole suite, integration tests included, plus the linter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test --vllm
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
