#!/usr/bin/env bash
# One command for a new vLLM release: install it light in a scratch venv, then print what
# changed and what broke.
#
#   bash scripts/check-vllm-release.sh VERSION
#
# 1. the light install (scripts/install-vllm-light-venv.sh) from
#    scripts/vllm-light-pins-VERSION.txt, or, if there is none yet, from the newest pins
#    file with its vllm line set to VERSION (written into the scratch folder);
# 2. the fingerprint diff against every verified version (which vLLM functions kvmetrics
#    depends on changed; kvmetrics/integrations/vllm/fingerprints.py);
# 3. the in-process suite, tests/test_vllm_*.py;
# 4. the defect canaries, `kvmetrics vllm-check`.
# Nothing in the checkout changes. KVMETRICS_RELEASE_DIR keeps the scratch folder (default:
# a new temporary one, removed at the end unless KVMETRICS_RELEASE_KEEP=1). Exit status 0
# only if every step passed. docs/user-guide.md, "Adding a vLLM version", says what to do next.
set -uo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-}"
if ! [[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "usage: check-vllm-release.sh VERSION (a vLLM release, e.g. 0.35.0)" >&2
  exit 2
fi
DIR="${KVMETRICS_RELEASE_DIR:-$(mktemp -d -t kvmetrics-vllm-XXXXXX)}"
mkdir -p "$DIR"
if [ -z "${KVMETRICS_RELEASE_DIR:-}" ] && [ "${KVMETRICS_RELEASE_KEEP:-0}" != 1 ]; then
  trap 'rm -rf "$DIR"' EXIT
fi
PINS="scripts/vllm-light-pins-$VERSION.txt"
if [ ! -f "$PINS" ]; then
  newest="$(ls scripts/vllm-light-pins-*.txt 2>/dev/null | sort -V | tail -n 1)"
  newest="${newest:-scripts/vllm-light-pins.txt}"
  sed "s/^vllm==.*/vllm==$VERSION/" "$newest" > "$DIR/pins.txt"
  PINS="$DIR/pins.txt"
  echo "no pins for $VERSION yet: trying those of $newest with vllm==$VERSION"
fi
VENV="$DIR/venv"
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
status=0
summary=()

echo "== installing vLLM $VERSION (light) in $VENV"
if ! KVMETRICS_VLLM_PINS="$PWD/$PINS" bash scripts/install-vllm-light-venv.sh "$VERSION" "$VENV"; then
  echo "check-vllm-release.sh: the light install failed (above); fix the pins first" >&2
  exit 1
fi

echo "== fingerprints of the vLLM code kvmetrics depends on"
if "$VENV/bin/python" -m kvmetrics.integrations.vllm.fingerprints; then
  summary+=("fingerprints: equal to a verified version")
else
  summary+=("fingerprints: DIFFER (listed above): read those functions' diffs")
  status=1
fi

echo "== in-process suite (tests/test_vllm_*.py)"
if "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_*.py \
    -o addopts="-m 'not slow'" | tee "$DIR/pytest.log" | tail -n 40; then
  summary+=("in-process suite: passed")
else
  summary+=("in-process suite: FAILED ($(grep -c '^FAILED' "$DIR/pytest.log") tests; list above)")
  status=1
fi

echo "== defect canaries (kvmetrics vllm-check)"
"$VENV/bin/python" -m kvmetrics.cli.main vllm-check
canary_status=$?
if [ "$canary_status" -eq 0 ]; then
  summary+=("canaries: ran (compare with docs/vllm-defects.md)")
elif [ "$canary_status" -eq 3 ]; then
  summary+=("canaries: some could not run on this vLLM (unknown, above): update them")
  status=1
else
  summary+=("canaries: FAILED to run or report (above)")
  status=1
fi

echo "== vLLM $VERSION"
printf '  %s\n' "${summary[@]}"
exit "$status"
