#!/usr/bin/env bash
# Light, CPU-only install of vLLM (0.33.0 by default) into the active Python environment:
# enough to import and run vLLM's real v1 scheduler (no model, no CUDA). A plain
# `pip install vllm==0.33.0` pulls torch 2.14.0 and the CUDA stack (several GB); this
# takes the CPU torch, vLLM and xgrammar without dependencies, then the pure-Python
# runtime deps the scheduler imports. Every version it installs comes from one pins file
# per vLLM version (its torch==, vllm== and xgrammar== lines included):
#   scripts/vllm-light-pins.txt          vLLM 0.33.0 (the default)
#   scripts/vllm-light-pins-VERSION.txt  any other version (0.34.0)
#
#   KVMETRICS_VLLM_VERSION  the vLLM version (default 0.33.0)
#   KVMETRICS_VLLM_PINS   the pins file (default: the one above for that version)
#   KVMETRICS_VLLM_FORCE  1: reinstall even if this pins file was installed already
#   KVMETRICS_VLLM_TARGET DIR: install only vLLM, without dependencies, into DIR, to be
#                         laid over the active environment (PYTHONPATH=DIR:...); refused
#                         unless that environment already has every other pin of the
#                         version's pins file at its exact version (CI's 0.34.0 over
#                         .venv's 0.33.0: the two pins files differ only in vllm)
#   PYTHON                the interpreter whose pip to use (default: the active python)
#
# Idempotent: a second run with the same pins only checks that the scheduler imports.
# pip's complaint about left-out CUDA-side dependencies is expected.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${KVMETRICS_VLLM_VERSION:-0.33.0}"
if [ "$VERSION" = 0.33.0 ]; then
  DEFAULT_PINS="$ROOT/scripts/vllm-light-pins.txt"
else
  DEFAULT_PINS="$ROOT/scripts/vllm-light-pins-$VERSION.txt"
fi
PINS="${KVMETRICS_VLLM_PINS:-$DEFAULT_PINS}"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ ! -f "$PINS" ]; then
  echo "install-vllm-light.sh: no pins for vLLM $VERSION: $PINS not found" \
       "(write one, see docs/user-guide.md, or set KVMETRICS_VLLM_PINS)" >&2
  exit 2
fi
pin() { grep -m1 -i "^$1==" "$PINS" || true; }
TORCH="$(pin torch)"
VLLM="$(pin vllm)"
XGRAMMAR="$(pin xgrammar)"
if [ -z "$TORCH" ] || [ -z "$XGRAMMAR" ] || [ "$VLLM" != "vllm==$VERSION" ]; then
  echo "install-vllm-light.sh: $PINS must pin torch, xgrammar and vllm==$VERSION" >&2
  exit 2
fi

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -n "${KVMETRICS_VLLM_TARGET:-}" ]; then
  TARGET="$KVMETRICS_VLLM_TARGET"
  # The base environment must already be this version's pins, vllm aside.
  if ! "$PY" - "$PINS" <<'PYEOF' >&2
import importlib.metadata as md
import re
import sys
wrong = []
for line in open(sys.argv[1]):
    m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
    if not m or m[1].lower() == "vllm":
        continue
    try:
        have = md.version(m[1])
    except md.PackageNotFoundError:
        have = "missing"
    if have.split("+")[0] != m[2]:
        wrong.append(f"{m[1]}=={m[2]} (have {have})")
if wrong:
    print("install-vllm-light.sh: the active environment does not hold these pins, so vLLM "
          "cannot be laid over it:", ", ".join(wrong))
    sys.exit(1)
PYEOF
  then
    exit 1
  fi
  marker="$TARGET/.kvmetrics-vllm-light"
  digest="$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$PINS")"
  if [ "${KVMETRICS_VLLM_FORCE:-0}" != 1 ] && [ -f "$marker" ] \
      && [ "$(cat "$marker")" = "$digest" ] \
      && PYTHONPATH="$TARGET" "$PY" -c 'import vllm.v1.core.sched.scheduler' >/dev/null 2>&1; then
    echo "vLLM $VERSION (light) already in $TARGET"
    exit 0
  fi
  rm -rf "$TARGET"
  "$PY" -m pip install -q --no-deps --target "$TARGET" "$VLLM" 2>&1 | grep -v '^WARNING: Location' || true
  if ! PYTHONPATH="$TARGET" "$PY" -c "import vllm, sys; assert vllm.__version__ == sys.argv[1], vllm.__version__; import vllm.v1.core.sched.scheduler" "$VERSION"; then
    echo "install-vllm-light.sh: vLLM $VERSION's scheduler does not import from $TARGET" >&2
    exit 1
  fi
  echo "$digest" > "$marker"
  echo "vLLM $VERSION (light) installed in $TARGET (lay it over $("$PY" -c 'import sys; print(sys.prefix)'))"
  exit 0
fi
prefix="$("$PY" -c 'import sys; print(sys.prefix)')"
marker="$prefix/.kvmetrics-vllm-light"
digest="$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$PINS")"

scheduler_imports() {
  "$PY" - "$VERSION" <<'PYEOF' >/dev/null 2>&1
import importlib.metadata as md
import sys
assert md.version("vllm") == sys.argv[1], md.version("vllm")
import vllm.v1.core.sched.scheduler  # noqa: F401
PYEOF
}

if [ "${KVMETRICS_VLLM_FORCE:-0}" != 1 ] && [ -f "$marker" ] \
    && [ "$(cat "$marker")" = "$digest" ] && scheduler_imports; then
  echo "vLLM $VERSION (light) already installed in $prefix"
  exit 0
fi

pip() { "$PY" -m pip "$@" 2>&1 | grep -v '^WARNING: Location' || true; }

pip install -q "$TORCH"
pip install -q --no-deps "$VLLM" "$XGRAMMAR"
grep -v -i -E '^(torch|vllm|xgrammar)==' "$PINS" > "$prefix/.kvmetrics-vllm-light-deps.txt"
pip install -q --no-deps -r "$prefix/.kvmetrics-vllm-light-deps.txt"

if ! scheduler_imports; then
  echo "install-vllm-light.sh: vLLM $VERSION's scheduler does not import after the install" >&2
  "$PY" -c 'import vllm.v1.core.sched.scheduler' >&2 || true
  exit 1
fi
echo "$digest" > "$marker"
echo "vLLM $VERSION (light) installed in $prefix"
