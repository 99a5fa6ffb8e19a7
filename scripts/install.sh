#!/usr/bin/env bash
# Install kvmetrics into ./.venv (created if missing).
#   --test   also the test tools and Debian's prometheus/promtool (needs root or sudo)
#   --vllm   also the light, CPU-only vLLM 0.33.0 install (scripts/install-vllm-light.sh)
# torch is installed first as the CPU build 2.13.0, so that nothing pulls a
# multi-GB CUDA build; set KVMETRICS_TORCH_SPEC to choose another torch.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
want_vllm=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --vllm) want_vllm=1 ;;
    *) echo "install.sh: unknown option $arg (use --test, --vllm)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true

pip install -q "${KVMETRICS_TORCH_SPEC:-torch==2.13.0}" 2>&1 | grep -v '^WARNING: Location' || true
python -c 'import torch' >/dev/null

if [ "$want_test" = 1 ]; then
  pip install -q -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
else
  pip install -q -e . 2>&1 | grep -v '^WARNING: Location' || true
fi
python -c 'import kvmetrics' >/dev/null

if [ "$want_vllm" = 1 ]; then
  bash scripts/install-vllm-light.sh
fi

if [ "$want_test" = 1 ] && ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus \
    >/dev/null
fi
echo "kvmetrics installed in .venv ($(.venv/bin/kvmetrics --version))"
