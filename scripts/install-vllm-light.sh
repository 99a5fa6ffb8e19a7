#!/usr/bin/env bash
# Light, CPU-only install of vLLM 0.33.0 into the active Python environment: enough
# to import and run vLLM's real v1 scheduler (no model, no CUDA). A plain
# `pip install vllm==0.33.0` pulls torch 2.14.0 and the CUDA stack (several GB);
# this takes the CPU torch 2.13.0, vLLM and xgrammar without dependencies, then the
# pure-Python runtime deps the scheduler imports, pinned in vllm-light-pins.txt.
#
#   KVMETRICS_VLLM_PINS   the pins file (default: scripts/vllm-light-pins.txt)
#   KVMETRICS_VLLM_FORCE  1: reinstall even if this pins file was installed already
#   PYTHON                the interpreter whose pip to use (default: the active python)
#
# Idempotent: a second run with the same pins only checks that the scheduler imports.
# pip's complaint about left-out CUDA-side dependencies is expected.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PINS="${KVMETRICS_VLLM_PINS:-$ROOT/scripts/vllm-light-pins.txt}"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ ! -f "$PINS" ]; then
  echo "install-vllm-light.sh: pins file not found: $PINS (set KVMETRICS_VLLM_PINS)" >&2
  exit 2
fi

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
prefix="$("$PY" -c 'import sys; print(sys.prefix)')"
marker="$prefix/.kvmetrics-vllm-light"
digest="$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$PINS")"

scheduler_imports() {
  "$PY" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as md
assert md.version("vllm") == "0.33.0", md.version("vllm")
import vllm.v1.core.sched.scheduler  # noqa: F401
EOF
}

if [ "${KVMETRICS_VLLM_FORCE:-0}" != 1 ] && [ -f "$marker" ] \
    && [ "$(cat "$marker")" = "$digest" ] && scheduler_imports; then
  echo "vLLM 0.33.0 (light) already installed in $prefix"
  exit 0
fi

pip() { "$PY" -m pip "$@" 2>&1 | grep -v '^WARNING: Location' || true; }

pip install -q torch==2.13.0
pip install -q --no-deps vllm==0.33.0 xgrammar==0.2.8
pip install -q --no-deps -r "$PINS"

if ! scheduler_imports; then
  echo "install-vllm-light.sh: vLLM's scheduler does not import after the install" >&2
  "$PY" -c 'import vllm.v1.core.sched.scheduler' >&2 || true
  exit 1
fi
echo "$digest" > "$marker"
echo "vLLM 0.33.0 (light) installed in $prefix"
