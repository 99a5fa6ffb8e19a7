#!/usr/bin/env bash
# Check the patch series of docs/vllm-patches/ against vLLM's own test suites.
#
#   scripts/test-vllm-series.sh [--ci] [--alone all|NNNN[,NNNN...]] [VERSION...]
#                                                       (default: 0.34.0 0.33.0)
#
# For each version: fetch the release's sdist from PyPI (pinned, sha256 checked,
# cached in .vllm-src/), apply the series to a copy of it (docs/vllm-patches/*.patch
# on 0.34.0, the backport docs/vllm-patches/0.33.0/*.patch on 0.33.0), lay the
# patched files over a copy of the installed vLLM of that version, and run vLLM's
# tests/v1/kv_connector/unit, tests/v1/core and tests/v1/metrics three times:
#   stock    the release's tests on the release as installed
#   patched  the patched tests on the patched scheduler
#   repro    the reproductions the series adds (its "Reproduces:" lines), on the
#            release as installed
# It fails when the series does not apply, when a test that passes on the release
# does not pass patched, or when a reproduction passes on the release or fails
# patched, and prints one summary line per version.
#
# --alone (full mode only) also checks patches one by one, each applied by itself
# to the release (as a pull request is reviewed), with the same verdicts and one
# more summary line per patch: "all" for every patch of the series, or the patch
# numbers (0004, or 0003,0004). The stock run is shared; each patch adds a patched
# and a repro run.
#
# Separate pull requests (SEPARATE below: 0005, the KV-load failure metrics) fix none
# of the defects and touch the recovery functions the fixes rewrite: they are never
# stacked on the series; the full mode always checks each alone.
#
# --ci runs a stated subset instead of the two directories (about 5 minutes for both
# versions instead of 17), for the series together only: the two test files the
# series changes, the remote prefill/decode lifecycle tests (async loads, aborts),
# tests/v1/core/test_scheduler.py and test_async_scheduler.py, and the kv_connector
# unit files that import vLLM's Scheduler. The full run's numbers are in
# docs/vllm-patches/README.md.
#
# The installed vLLM is the project's: 0.33.0 in .venv (scripts/install.sh --vllm),
# 0.34.0 in .vllm-versions/0.34.0-light laid over it (install.sh --test --vllm).
# The light install has no GPU and no model weights: the tests run with
# VLLM_TARGET_DEVICE=cpu, offline, with a config.json of facebook/opt-125m (the
# model vLLM's test utils name) in a private HF cache, and with the pytest plugin
# kvmetrics.lab.vllm.pytest_cpu_env (vLLM 0.34's CPU platform refuses
# a config without Triton). Tests that still cannot run here fail on the release
# as well; only tests passing on the release are held to passing patched.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
CACHE=$REPO/.vllm-src
# Patch numbers of the separate pull requests (SEPARATE in
# kvmetrics/lab/vllm/series.py names the same files).
SEPARATE=(0005)

usage_error() {
  echo "test-vllm-series.sh: $1 (usage: [--ci] [--alone all|NNNN[,NNNN...]] [VERSION...])" >&2
  exit 2
}

mode=full
alone=
versions=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ci) mode=ci ;;
    --alone=*) alone=${1#--alone=} ;;
    --alone) [ $# -gt 1 ] || usage_error "--alone needs all or patch numbers such as 0004"
             alone=$2; shift ;;
    [0-9]*.[0-9]*.[0-9]*) versions+=("$1") ;;
    *) usage_error "unknown argument $1" ;;
  esac
  shift
done
[ ${#versions[@]} -gt 0 ] || versions=(0.34.0 0.33.0)
if [ -n "$alone" ]; then
  [ "$mode" = full ] || usage_error "--alone runs in the full mode only, not with --ci"
  [[ "$alone" =~ ^(all|[0-9]{4}(,[0-9]{4})*)$ ]] ||
    usage_error "--alone takes all or patch numbers such as 0004 or 0003,0004, not '$alone'"
fi

sdist_url() {
  case "$1" in
    0.34.0) echo "https://files.pythonhosted.org/packages/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz" ;;
    0.33.0) echo "https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz" ;;
    *) return 1 ;;
  esac
}
sdist_sha256() {
  case "$1" in
    0.34.0) echo fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113 ;;
    0.33.0) echo f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112 ;;
  esac
}
series_dir() {
  case "$1" in
    0.34.0) echo "$REPO/docs/vllm-patches" ;;
    *) echo "$REPO/docs/vllm-patches/$1" ;;
  esac
}
# PYTHONPATH entry that makes the installed vLLM of this version importable from .venv.
vllm_overlay() {
  if [ -d "$REPO/.vllm-versions/$1-light/vllm" ]; then echo "$REPO/.vllm-versions/$1-light"; fi
}

fetch_sdist() {
  local version=$1 tarball=$CACHE/vllm-$1.tar.gz
  mkdir -p "$CACHE"
  if [ ! -f "$tarball" ] || ! echo "$(sdist_sha256 "$version")  $tarball" | sha256sum -c --quiet - 2>/dev/null; then
    echo "fetching the vLLM $version sdist"
    curl -sSfL --retry 3 -o "$tarball.part" "$(sdist_url "$version")"
    mv "$tarball.part" "$tarball"
  fi
  echo "$(sdist_sha256 "$version")  $tarball" | sha256sum -c --quiet - || {
    echo "vLLM $version sdist: sha256 mismatch" >&2; return 1; }
}

# A config.json of facebook/opt-125m in a private HF cache (no weights, no download).
model_cache() {
  local snap=$CACHE/hf/hub/models--facebook--opt-125m/snapshots/0000000000000000000000000000000000000000
  mkdir -p "$snap" "$CACHE/hf/hub/models--facebook--opt-125m/refs"
  printf 0000000000000000000000000000000000000000 > "$CACHE/hf/hub/models--facebook--opt-125m/refs/main"
  cat > "$snap/config.json" <<'JSON'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": 50272,
 "hidden_size": 768, "word_embed_proj_dim": 768, "ffn_dim": 3072, "num_hidden_layers": 12,
 "num_attention_heads": 12, "max_position_embeddings": 2048, "do_layer_norm_before": true,
 "activation_function": "relu", "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
 "torch_dtype": "float16"}
JSON
}

run_pytest() {  # run_pytest TREE VLLM_PATH JUNIT ARGS...
  local tree=$1 vllm_path=$2 junit=$3
  shift 3
  (cd "$tree" && PYTHONPATH="${vllm_path:+$vllm_path:}$tree:$REPO" VLLM_TARGET_DEVICE=cpu \
     HF_HUB_OFFLINE=1 HF_HOME="$CACHE/hf" "$PYTHON" -m pytest -q -p no:cacheprovider \
     -p kvmetrics.lab.vllm.pytest_cpu_env --confcutdir tests/v1 \
     --continue-on-collection-errors --junitxml="$junit" "$@" > "$junit.log" 2>&1) || true
  [ -s "$junit" ] || { echo "pytest wrote no report, see $junit.log" >&2; return 1; }
}

is_separate() {
  [[ " ${SEPARATE[*]} " == *" $(basename "$1" | cut -c1-4) "* ]]
}

# The patch files that --alone names for this version, one a line.
alone_patches() {
  local series; series=$(series_dir "$1")
  if [ "$alone" = all ]; then
    printf '%s\n' "$series"/[0-9][0-9][0-9][0-9]-*.patch
    return
  fi
  local number found
  for number in ${alone//,/ }; do
    found=("$series/$number"-*.patch)
    [ -f "${found[0]}" ] || {
      echo "test-vllm-series.sh: no patch $number in the series for vLLM $1" >&2; return 1; }
    printf '%s\n' "${found[0]}"
  done
}

# check_patches VERSION NAME LABEL INSTALLED OVERLAY PATCH...: apply the patches
# to a fresh copy of the release's sources (in $CACHE/VERSION/NAME), lay the changed
# files over a copy of the installed vLLM, run the patched and repro runs, and judge
# them against the version's stock run.
check_patches() {
  local version=$1 name=$2 label=$3 installed=$4 overlay=$5
  shift 5
  local patches=("$@") work=$CACHE/$version
  local dir=$work/$name
  rm -rf "$dir"
  mkdir -p "$dir"
  cp -r "$work/release" "$dir/tree"
  # Its own repository, so that git apply takes the patch paths from there (inside
  # this project's checkout it would skip them as lying outside the folder).
  git -C "$dir/tree" init -q
  local patch
  for patch in "${patches[@]}"; do
    if ! (cd "$dir/tree" && git apply --check "$patch" && git apply "$patch"); then
      echo "vLLM $version ($mode, $label): does not apply: $(basename "$patch")"
      return 1
    fi
  done
  local changed
  changed=$(cd "$dir/tree" && for patch in "${patches[@]}"; do
    git apply --numstat "$patch"; done | awk '{print $3}' | grep '^vllm/' | sort -u)
  # The sdist's vllm/ sources leave the test tree: pytest puts a tree's root first
  # on sys.path, and the tests must import the installed vLLM (or its patched copy).
  mv "$dir/tree/vllm" "$dir/src"
  local file
  for file in $changed; do
    cmp -s "$work/release/$file" "$installed/${file#vllm/}" || {
      echo "the installed vLLM $version differs from its sdist in $file" >&2; return 1; }
  done
  mkdir -p "$dir/pkg"
  cp -al "$installed" "$dir/pkg/vllm" 2>/dev/null || cp -r "$installed" "$dir/pkg/vllm"
  for file in $changed; do
    rm -f "$dir/pkg/$file"
    cp "$dir/src/${file#vllm/}" "$dir/pkg/$file"
  done

  local targets reproductions
  mapfile -t targets < "$work/targets"
  mapfile -t reproductions < <(sed -n 's/^Reproduces: //p' "${patches[@]}")
  if [ ${#reproductions[@]} -eq 0 ]; then
    echo "vLLM $version ($mode, $label): no \"Reproduces:\" line in $(basename "${patches[0]}")"
    return 1
  fi
  run_pytest "$dir/tree" "$dir/pkg" "$dir/patched.xml" "${targets[@]}"
  run_pytest "$dir/tree" "$overlay" "$dir/repro.xml" "${reproductions[@]}"
  "$PYTHON" scripts/vllm-series-compare.py "$version" "$mode, $label" \
    "$work/stock.xml" "$dir/patched.xml" "$dir/repro.xml" "${reproductions[@]}"
}

check_version() {
  local version=$1 started=$SECONDS status=0
  local series; series=$(series_dir "$version")
  sdist_url "$version" > /dev/null || { echo "no pinned sdist for vLLM $version" >&2; return 1; }
  local patches=() patch
  for patch in "$series"/[0-9][0-9][0-9][0-9]-*.patch; do
    if [ -f "$patch" ] && ! is_separate "$patch"; then patches+=("$patch"); fi
  done
  [ ${#patches[@]} -gt 0 ] || { echo "no series for vLLM $version in $series" >&2; return 1; }
  local singles=()
  if [ -n "$alone" ]; then mapfile -t singles < <(alone_patches "$version"); fi
  if [ "$mode" = full ]; then
    for patch in "$series"/[0-9][0-9][0-9][0-9]-*.patch; do
      if [ -f "$patch" ] && is_separate "$patch" &&
         [[ " ${singles[*]} " != *" $patch "* ]]; then singles+=("$patch"); fi
    done
  fi
  fetch_sdist "$version"

  # The installed vLLM of this version.
  local overlay; overlay=$(vllm_overlay "$version")
  local installed
  installed=$(PYTHONPATH="$overlay" "$PYTHON" -c \
    "import os, vllm; print(vllm.__version__, os.path.dirname(vllm.__file__))" 2>/dev/null) || true
  if [ "${installed%% *}" != "$version" ]; then
    echo "vLLM $version is not installed here (found: ${installed:-none}); see scripts/install.sh" >&2
    return 1
  fi
  installed=${installed#* }

  local work=$CACHE/$version
  rm -rf "$work"
  mkdir -p "$work/release" "$work/stock"
  tar -xzf "$CACHE/vllm-$version.tar.gz" -C "$work/release" --strip-components=1 \
    "vllm-$version/vllm" "vllm-$version/tests" "vllm-$version/pyproject.toml" \
    "vllm-$version/docs/design"
  # The release's tests, never modified: hard links where the filesystem allows.
  cp -al "$work/release/tests" "$work/release/pyproject.toml" "$work/stock/" 2>/dev/null ||
    cp -r "$work/release/tests" "$work/release/pyproject.toml" "$work/stock/"

  local targets=(tests/v1/kv_connector/unit tests/v1/core tests/v1/metrics)
  if [ "$mode" = ci ]; then
    targets=(tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py
             tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py
             tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py
             tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py
             tests/v1/core/test_scheduler.py tests/v1/core/test_async_scheduler.py)
    local f
    for f in $(cd "$work/stock" && grep -l "^from vllm.v1.core.sched.scheduler import" \
                 tests/v1/kv_connector/unit/test_*.py | sort); do
      case " ${targets[*]} " in *" $f "*) ;; *) targets+=("$f") ;; esac
    done
  fi
  printf '%s\n' "${targets[@]}" > "$work/targets"

  model_cache
  run_pytest "$work/stock" "$overlay" "$work/stock.xml" "${targets[@]}"
  check_patches "$version" series "${#patches[@]} patches" "$installed" "$overlay" \
    "${patches[@]}" || status=1
  local number
  for patch in "${singles[@]}"; do
    number=$(basename "$patch" | cut -c1-4)
    check_patches "$version" "$number-alone" "$number alone" "$installed" "$overlay" \
      "$patch" || status=1
  done
  echo "  ($((SECONDS - started)) s; logs and JUnit reports in ${work#"$REPO"/}/)"
  return $status
}

# A patch number --alone names must exist for every version, before anything runs.
if [ -n "$alone" ]; then
  for version in "${versions[@]}"; do
    alone_patches "$version" > /dev/null || exit 2
  done
fi

failed=0
for version in "${versions[@]}"; do
  check_version "$version" || failed=1
done
exit $failed
