#!/usr/bin/env bash
# One command for a new vLLM build: print which vLLM functions kvmetrics depends on changed
# and what broke.
#
#   bash scripts/check-vllm-release.sh [--quick] VERSION | WHEEL | SDIST | SOURCE_TREE
#
# VERSION (a release, e.g. 0.35.0): installed light in a scratch venv
# (scripts/install-vllm-light-venv.sh) from scripts/vllm-light-pins-VERSION.txt, or, if
# there is none yet, from the newest pins file with its vllm line set to VERSION.
# WHEEL (vllm-*.whl), SDIST (vllm-*.tar.gz) or SOURCE_TREE (a directory holding vllm/,
# such as a git checkout of vLLM main): its vllm/ Python package is laid over the light
# vLLM of .venv on PYTHONPATH (KVMETRICS_RELEASE_PYTHON: another interpreter), without
# building C extensions; a build needing newer dependencies than .venv's fails to import.
# Then, in that vLLM:
# 1. the fingerprint diff: every function of the derived verified set that differs from
#    the record of the same version, or else of the newest verified version
#    (kvmetrics/vllm/fingerprints.py);
# 2. the hook table against vLLM's classes: hooks missing or with another signature,
#    attributes missing (kvmetrics/vllm/static_hooks.py);
# 3. the in-process suite, tests/test_vllm_*.py;
# 4. the defect canaries, `kvmetrics vllm-check`.
# --quick stops after 2. Nothing in the checkout changes. KVMETRICS_RELEASE_DIR keeps the
# scratch folder (default: a new temporary one, removed at the end unless
# KVMETRICS_RELEASE_KEEP=1). Exit status 0 only if every step passed, 2 for a bad
# argument. docs/user-guide.md, "Adding a vLLM version", says what to do next.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: check-vllm-release.sh [--quick] VERSION|WHEEL|SDIST|SOURCE_TREE (e.g. 0.35.0, vllm-0.35.0-cp38-abi3-linux_x86_64.whl, vllm-0.35.0.tar.gz, ~/src/vllm)"
QUICK=0
if [ "${1:-}" = --quick ]; then QUICK=1; shift; fi
BUILD="${1:-}"
if [ $# -ne 1 ] || [ -z "$BUILD" ]; then echo "$usage" >&2; exit 2; fi
if [[ "$BUILD" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  KIND=release
elif [ -d "$BUILD" ]; then
  KIND=tree
  [ -f "$BUILD/vllm/__init__.py" ] || { echo "check-vllm-release.sh: $BUILD holds no vllm/__init__.py (not a vLLM source tree)" >&2; exit 2; }
elif [ -f "$BUILD" ] && [[ "$BUILD" == *.whl ]]; then
  KIND=wheel
elif [ -f "$BUILD" ] && [[ "$BUILD" == *.tar.gz || "$BUILD" == *.tgz ]]; then
  KIND=sdist
else
  echo "check-vllm-release.sh: $BUILD is neither a version X.Y.Z, a .whl or .tar.gz file, nor a directory; $usage" >&2
  exit 2
fi
DIR="${KVMETRICS_RELEASE_DIR:-$(mktemp -d -t kvmetrics-vllm-XXXXXX)}"
mkdir -p "$DIR"
if [ -z "${KVMETRICS_RELEASE_DIR:-}" ] && [ "${KVMETRICS_RELEASE_KEEP:-0}" != 1 ]; then
  trap 'rm -rf "$DIR"' EXIT
fi
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONPATH="$PWD"
PY="${KVMETRICS_RELEASE_PYTHON:-$PWD/.venv/bin/python}"
case "$KIND" in
  release)
    PINS="scripts/vllm-light-pins-$BUILD.txt"
    if [ ! -f "$PINS" ]; then
      newest="$(ls scripts/vllm-light-pins-*.txt 2>/dev/null | sort -V | tail -n 1)"
      newest="${newest:-scripts/vllm-light-pins.txt}"
      sed "s/^vllm==.*/vllm==$BUILD/" "$newest" > "$DIR/pins.txt"
      PINS="$DIR/pins.txt"
      echo "no pins for $BUILD yet: trying those of $newest with vllm==$BUILD"
    fi
    echo "== installing vLLM $BUILD (light) in $DIR/venv"
    if ! KVMETRICS_VLLM_PINS="$PWD/$PINS" bash scripts/install-vllm-light-venv.sh "$BUILD" "$DIR/venv"; then
      echo "check-vllm-release.sh: the light install failed (above); fix the pins first" >&2
      exit 1
    fi
    PY="$DIR/venv/bin/python";;
  tree) OVERLAY="$(cd "$BUILD" && pwd)";;
  wheel)
    OVERLAY="$DIR/wheel"
    "$PY" -m zipfile -e "$BUILD" "$OVERLAY" || { echo "check-vllm-release.sh: $BUILD is not a readable wheel" >&2; exit 2; };;
  sdist)
    mkdir -p "$DIR/sdist"
    tar -xzf "$BUILD" -C "$DIR/sdist" || { echo "check-vllm-release.sh: $BUILD is not a readable sdist" >&2; exit 2; }
    OVERLAY="$(dirname "$(find "$DIR/sdist" -maxdepth 3 -path '*/vllm/__init__.py' | head -n 1)")"
    OVERLAY="$(dirname "$OVERLAY")";;
esac
if [ "$KIND" != release ]; then
  [ -f "$OVERLAY/vllm/__init__.py" ] || { echo "check-vllm-release.sh: no vllm/ package in $BUILD" >&2; exit 2; }
  [ -x "$PY" ] || { echo "check-vllm-release.sh: no interpreter at $PY (scripts/install.sh --vllm makes .venv)" >&2; exit 2; }
  export PYTHONPATH="$OVERLAY:$PWD"
  echo "== vLLM from $BUILD, its vllm/ laid over $("$PY" -c 'import sys; print(sys.prefix)')"
fi
status=0
summary=()

echo "== fingerprints of the vLLM code kvmetrics depends on, and the hook table"
"$PY" -m kvmetrics.vllm.static_hooks --fingerprints-against newest
checked=$?
if [ "$checked" -eq 2 ] || [ "$checked" -gt 5 ]; then
  summary+=("fingerprints and hook table: could not run (above)")
  status=1
else
  if [ $((checked & 1)) -eq 0 ]; then
    summary+=("fingerprints: equal to a verified version")
  else
    summary+=("fingerprints: DIFFER (listed above): read those functions' diffs")
    status=1
  fi
  if [ $((checked & 4)) -eq 0 ]; then
    summary+=("hook table: every hook and attribute as expected")
  else
    summary+=("hook table: BROKEN (listed above): adapt kvmetrics/vllm/hooks.py")
    status=1
  fi
fi

if [ "$QUICK" = 0 ]; then
  echo "== in-process suite (tests/test_vllm_*.py)"
  if "$PY" -m pytest -q -p no:cacheprovider tests/test_vllm_*.py \
      | tee "$DIR/pytest.log" | tail -n 40; then
    summary+=("in-process suite: passed")
  else
    summary+=("in-process suite: FAILED ($(grep -c '^FAILED' "$DIR/pytest.log") tests; list above)")
    status=1
  fi

  echo "== defect canaries (kvmetrics vllm-check)"
  "$PY" -m kvmetrics.cli.main vllm-check
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
fi

echo "== vLLM $BUILD"
printf '  %s\n' "${summary[@]}"
exit "$status"
