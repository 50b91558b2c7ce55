#!/usr/bin/env bash
# Every test: installs what is missing, checks formatting, builds with
# warnings as errors and runs the whole suite; then again under
# AddressSanitizer + UndefinedBehaviorSanitizer; then each libFuzzer target
# (tests/fuzz) for LAYERCAST_FUZZ_SECONDS (default 60).
# LAYERCAST_SKIP_SANITIZERS=1 runs only the plain build.
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
  echo "== test $dir (built at ${SECONDS}s)"
  # shellcheck disable=SC2086
  ctest --test-dir "$dir" --output-on-failure --timeout 600 -j"$jobs" $ctest_args
  echo "== $dir done at ${SECONDS}s"
}

run_suite build "" "" -DCMAKE_BUILD_TYPE=RelWithDebInfo
if [ "${LAYERCAST_SKIP_SANITIZERS:-0}" != 1 ]; then
  # Without CUDA: the plain build compiles the GPU code, and its tests skip
  # without a GPU under any build.
  run_suite build-asan "" "" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DLAYERCAST_SANITIZE=address,undefined -DLAYERCAST_BUILD_BENCH=OFF -DLAYERCAST_WITH_CUDA=OFF
  # No ThreadSanitizer stage: Debian's abseil is not built with TSan, so TSan
  # cannot see absl::Mutex and reports every absl::Mutex-guarded field as a
  # race (tried: 139 such reports in the concurrency tests). The label
  # `concurrency` marks the tests to run under TSan with an instrumented
  # abseil: LAYERCAST_SANITIZE=thread, ctest -L concurrency.
  tests/fuzz/run_fuzzers.sh "${LAYERCAST_FUZZ_SECONDS:-60}"
fi
