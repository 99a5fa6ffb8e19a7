#!/usr/bin/env bash
# The torch KV data plane on an NVIDIA GPU: its CUDA load path, its verifier and its
# benchmark, in at most 8 minutes, with the torch already installed on that machine.
#
#   bash scripts/gpu-check.sh [OUTPUT.json]
#
# kvmetrics runs from this checkout (PYTHONPATH): nothing is installed or downloaded.
# Python: $PYTHON, else python3. The figures go to one JSON file: $OUT/gpu-check.json
# when $OUT is set, else the argument, else ./gpu-check.json; a summary goes to stdout.
# Each stage runs in its own process under its own limit, so a stage that hangs or
# crashes costs only its limit and shows up in the file as "timed out" or "crashed".
# Without a CUDA device it refuses in one line and exits 3. Exit 0: every stage
# passed; 1: a stage failed, crashed or ran out of time (the file says which).
# GPU_CHECK_REHEARSE=cpu runs every stage on the CPU instead, to rehearse the script on
# a machine without a GPU: its file and summary say "rehearsal", and no figure in it
# is a GPU figure.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ -n "${OUT:-}" ]; then
  output=$OUT/gpu-check.json
else
  output=${1:-gpu-check.json}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
device=cuda
if [ "${GPU_CHECK_REHEARSE:-}" = cpu ]; then
  device=cpu
elif [ -n "${GPU_CHECK_REHEARSE:-}" ]; then
  echo "gpu-check: GPU_CHECK_REHEARSE must be cpu or unset, got '$GPU_CHECK_REHEARSE'" >&2
  exit 2
fi

# stage:limit in seconds. Worst case, every process killed at its limit plus the 5 s
# grace of `timeout -k 5`: CUDA check 20, stages 30 + 75 + 75 + 130 + 95 = 405, report
# 20, graces 7 x 5 = 35: 480 s, the 8 minutes.
STAGES="preflight:30 load:75 verify:75 bench-load:130 bench-verify:95"
parts=$(mktemp -d)
trap 'rm -rf "$parts"' EXIT

if ! refusal=$(timeout -k 5 20 "$python" -c \
    'from benchmarks.gpu_check import cuda_or_refusal as r; m = r(); print(m or "")' 2>&1); then
  echo "gpu-check: $python cannot load benchmarks.gpu_check: ${refusal:-no output}" \
    | tail -n 1 >&2
  exit 3
fi
if [ "$device" = cuda ] && [ -n "$refusal" ]; then
  echo "$refusal" >&2
  exit 3
fi

for entry in $STAGES; do
  stage=${entry%%:*}
  limit=${entry##*:}
  echo "gpu-check: $stage (limit ${limit} s)"
  start=$(date +%s.%N)
  timeout -k 5 "$limit" "$python" -m benchmarks.gpu_check "$stage" --part "$parts/$stage.json" \
    --device "$device"
  code=$?
  end=$(date +%s.%N)
  seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
  echo "$stage $code $seconds $limit" >> "$parts/status.tsv"
done

timeout -k 5 20 "$python" -m benchmarks.gpu_report "$parts" "$output"
