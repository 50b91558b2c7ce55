#!/usr/bin/env bash
# Every test: installs what is missing, checks formatting, builds with
# warnings as errors and runs the whole suite; then again under
# AddressSanitizer + UndefinedBehaviorSanitizer; then the concurrency tests
# (those that run without gRPC, whose Debian build is not instrumented) under
# ThreadSanitizer; then each libFuzzer target (tests/fuzz) for
# LAYERCAST_FUZZ_SECONDS (default 60). LAYERCAST_SKIP_SANITIZERS=1 runs only
# the plain build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc)

echo "== clang-format"
sources=$(git ls-files '*.cc' '*.h' 2>/dev/null || find core server client tests bench -name '*.cc' -o -name '*.h')
clang-format --dry-run --Werror $sources

# run_suite DIR "CTEST ARGS" "TARGETS" CMAKE_ARGS...: configure, build TARGETS
# (all when empty) and run ctest with CTEST ARGS.
run_suite() {
  local dir=$1 ctest_args=$2 targets=$3; shift 3
  echo "== build $dir ($*)"
  cmake -S . -B "$dir" -DLAYERCAST_WERROR=ON "$@" >/dev/null
  if [ -n "$targets" ]; then
    cmake --build "$dir" -j"$jobs" --target $targets
  else
    cmake --build "$dir" -j"$jobs"
  fi
  echo "== test $dir"
  # shellcheck disable=SC2086
  ctest --test-dir "$dir" --output-on-failure --timeout 600 -j"$jobs" $ctest_args
}

run_suite build "" "" -DCMAKE_BUILD_TYPE=RelWithDebInfo
if [ "${LAYERCAST_SKIP_SANITIZERS:-0}" != 1 ]; then
  run_suite build-asan "" "" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DLAYERCAST_SANITIZE=address,undefined -DLAYERCAST_BUILD_BENCH=OFF
  run_suite build-tsan "-L concurrency" "client_concurrency_test server_concurrency_test" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLAYERCAST_SANITIZE=thread -DLAYERCAST_BUILD_BENCH=OFF
  tests/fuzz/run_fuzzers.sh "${LAYERCAST_FUZZ_SECONDS:-60}"
fi
