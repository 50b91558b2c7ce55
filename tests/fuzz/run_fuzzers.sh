#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan, coverage inside the
# layercast libraries too) and runs each for SECONDS (default 60) on a copy of
# its seed corpus, as many at once as there are cores (each still gets its
# SECONDS). Any crash, leak, timeout, out-of-memory or sanitizer report
# fails the run; the input that caused it is kept under
# BUILD/fuzz-artifacts/<target>/ with the command that reproduces it.
#
#   tests/fuzz/run_fuzzers.sh [SECONDS] [TARGET...]    (targets: safetensors policy manifest chunk_decoder delta_chunk gradient_decoder fetch_plan publish_stage)
#
# LAYERCAST_FUZZ_BUILD=DIR uses a build already configured with clang,
# -DLAYERCAST_FUZZ=ON and -DLAYERCAST_SANITIZE=address,undefined,fuzzer-no-link
# (scripts/test.sh's instrumented build) instead of configuring build-fuzz.
set -euo pipefail
cd "$(dirname "$0")/../.."

seconds=${1:-60}
shift || true
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then targets=(safetensors policy manifest chunk_decoder delta_chunk gradient_decoder fetch_plan publish_stage); fi
build=${LAYERCAST_FUZZ_BUILD:-build-fuzz}
jobs=$(nproc)

if [ -z "${LAYERCAST_FUZZ_BUILD:-}" ]; then
  echo "== build $build (clang, libFuzzer, address,undefined)"
  CC=clang CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DLAYERCAST_FUZZ=ON -DLAYERCAST_SANITIZE=address,undefined,fuzzer-no-link \
    -DLAYERCAST_BUILD_TESTS=ON -DLAYERCAST_BUILD_BENCH=OFF -DLAYERCAST_WITH_CUDA=OFF >/dev/null
fi
# The server and worker libraries too: clang's -Wthread-safety
# (layercast::build_options) checks every lock annotation in them.
cmake --build "$build" -j"$jobs" --target "${targets[@]/%/_fuzzer}" layercast_server layercast_client

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# fuzz_one TARGET: runs it, leaving its exit status in $work/TARGET.rc.
fuzz_one() {
  local target=$1
  local binary=$build/tests/fuzz/${target}_fuzzer
  local corpus=$work/corpus/$target
  local artifacts=$build/fuzz-artifacts/$target
  rm -rf "$artifacts"
  mkdir -p "$corpus" "$artifacts"
  cp tests/fuzz/corpus/"$target"/* "$corpus"/
  local dict=()
  if [ -f tests/fuzz/dict/"$target".dict ]; then dict=(-dict=tests/fuzz/dict/"$target".dict); fi
  local rc=0
  "$binary" "$corpus" "${dict[@]}" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
    -print_final_stats=1 -artifact_prefix="$artifacts"/ >"$work/$target.log" 2>&1 || rc=$?
  echo "$rc" >"$work/$target.rc"
}

echo "== fuzz ${targets[*]} for ${seconds}s each, $jobs at a time"
running=0
for target in "${targets[@]}"; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  fuzz_one "$target" &
  running=$((running + 1))
done
wait

passed=0
failed=0
for target in "${targets[@]}"; do
  binary=$build/tests/fuzz/${target}_fuzzer
  artifacts=$build/fuzz-artifacts/$target
  log=$work/$target.log
  rc=$(cat "$work/$target.rc" 2>/dev/null || echo "no status")
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  coverage=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9]+[a-zA-Z]*' "$log" | tail -1 || true)
  if [ "$rc" = 0 ] && ! grep -qE 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:' "$log"; then
    echo "fuzz: $target passed: ${runs:-?} runs in ${seconds}s, $coverage"
    passed=$((passed + 1))
  else
    echo "fuzz: $target FAILED (exit $rc): ${runs:-?} runs, $coverage"
    grep -E -A40 'ERROR: |runtime error:|property violated|deadly signal' "$log" | head -80 || tail -60 "$log"
    for input in "$artifacts"/*; do
      [ -e "$input" ] && echo "reproduce: $binary $input"
    done
    failed=$((failed + 1))
  fi
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
