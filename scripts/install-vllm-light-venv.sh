#!/usr/bin/env bash
# A venv of its own for one more light vLLM version: kvmetrics (editable, with its data
# plane and test tools, at the versions of scripts/constraints.txt), then the light vLLM
# VERSION from its pins file (scripts/install-vllm-light.sh). Used for the in-process
# tests on a vLLM other than .venv's 0.33.0 (scripts/test.sh runs them on 0.34.0 in
# .venv-vllm-034) and by scripts/check-vllm-release.sh for a new release.
#
#   bash scripts/install-vllm-light-venv.sh VERSION [VENV]   (VENV: default .venv-vllm-0XY)
#
# Idempotent: a second run only checks what is there. pip's output goes to VENV/install.log.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:?usage: install-vllm-light-venv.sh VERSION [VENV]}"
if ! [[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "install-vllm-light-venv.sh: not a vLLM release version: $VERSION" >&2
  exit 2
fi
minor="${VERSION#*.}"
minor="${minor%%.*}"
VENV="${2:-.venv-vllm-0$minor}"
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
LOG="$VENV/install.log"
: > "$LOG"
export PIP_DISABLE_PIP_VERSION_CHECK=1
step() {
  local what=$1
  shift
  if ! "$@" >> "$LOG" 2>&1; then
    echo "install-vllm-light-venv.sh: $what failed; its output (from $LOG):" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}
step "installing torch" "$VENV/bin/python" -m pip install -q -c scripts/constraints.txt torch
step "installing kvmetrics" "$VENV/bin/python" -m pip install -q -c scripts/constraints.txt \
  -e ".[dataplane,test]"
step "installing the light vLLM $VERSION" env PYTHON="$VENV/bin/python" \
  KVMETRICS_VLLM_VERSION="$VERSION" bash scripts/install-vllm-light.sh
tail -n 1 "$LOG"
