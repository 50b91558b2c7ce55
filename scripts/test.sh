#!/usr/bin/env bash
# Every test: installs what is missing, checks formatting, builds with
# warnings as errors and runs the whole suite; then the benchmarks briefly as
# regression guards (bench/smoke.py: counted delta bytes past today's + 5%,
# or a timed ratio past 1.5x its goal twice in a row, fails); then the suite again, built with clang under
# AddressSanitizer + UndefinedBehaviorSanitizer; then each libFuzzer target
# (tests/fuzz), linked in that same build, for LAYERCAST_FUZZ_SECONDS
# (default 45), as many at once as there are cores.
# LAYERCAST_SKIP_SANITIZERS=1 runs only the plain build.
#
# The image test (ctest label `image`: the Dockerfile built with podman,
# which compiles the binaries again inside it) runs beside the ASan build,
# not beside the plain suite: on 2 cores its compile starved timed tests
# there (a worker's stream counted stalled after 300 ms), while a build
# only takes longer.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc)

# Each stage's time, printed at the end (and when a stage fails).
stage_names=()
stage_seconds=()
stage_started=$SECONDS
stage_done() {
  stage_names+=("$1")
  stage_seconds+=($((SECONDS - stage_started)))
  stage_started=$SECONDS
}
image_pid=
on_exit() {
  # A failed build leaves no image test running behind it.
  if [ -n "$image_pid" ]; then
    pkill -TERM -P "$image_pid" 2>/dev/null || true
    kill "$image_pid" 2>/dev/null || true
  fi
  echo "== stage times (total ${SECONDS}s)"
  local i
  for i in "${!stage_names[@]}"; do
    printf '   %-44s %5ss\n' "${stage_names[$i]}" "${stage_seconds[$i]}"
  done
}
trap on_exit EXIT
stage_done "install dependencies"

echo "== clang-format"
sources=$(git ls-files '*.cc' '*.h' 2>/dev/null || find core server client tests bench -name '*.cc' -o -name '*.h')
clang-format --dry-run --Werror $sources
stage_done "clang-format"

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
  stage_done "build $dir"
  echo "== test $dir (built at ${SECONDS}s)"
  # shellcheck disable=SC2086
  ctest --test-dir "$dir" --output-on-failure --timeout 600 -j"$jobs" $ctest_args
  stage_done "test $dir"
  echo "== $dir done at ${SECONDS}s"
}

# Under CI (LAYERCAST_CI=1, set by .ci/run) nothing the tests need may be
# missing: a missing PyTorch, openssl, podman or root fails its test
# (tests/prerequisite.h, tests/deploy/image_test.sh) instead of skipping, and
# a missing Python, pybind11 or dlpack fails the configure
# (LAYERCAST_REQUIRE_ALL) instead of leaving the Python tests unregistered.
require_all=OFF
[ "${LAYERCAST_CI:-0}" = 1 ] && require_all=ON
run_suite build "-LE image" "" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLAYERCAST_REQUIRE_ALL=$require_all
# On quiet cores, before the image's compile starts beside the ASan build.
echo "== bench smoke"
bench/smoke.py build
stage_done "bench smoke"
image_log=build/image-test.log
run_image_test() {
  ctest --test-dir build --output-on-failure --timeout 2400 -L image >"$image_log" 2>&1
}
if [ "${LAYERCAST_SKIP_SANITIZERS:-0}" = 1 ]; then
  echo "== image test (built at ${SECONDS}s)"
  run_image_test || { cat "$image_log"; exit 1; }
  cat "$image_log"
  stage_done "image test"
else
  echo "== image test, in the background beside the instrumented build (started at ${SECONDS}s)"
  run_image_test &
  image_pid=$!
  # One instrumented build: clang with AddressSanitizer, UndefinedBehavior-
  # Sanitizer and libFuzzer's coverage (fuzzer-no-link) on every target, and
  # -Wthread-safety (layercast::build_options) over all of them. It runs the
  # suite a second time and links the fuzzers: no third compile. Without
  # CUDA: the plain build compiles the GPU code, and its tests skip without a
  # GPU under any build.
  san_flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++
    -DLAYERCAST_SANITIZE=address,undefined,fuzzer-no-link -DLAYERCAST_FUZZ=ON
    -DLAYERCAST_BUILD_BENCH=OFF -DLAYERCAST_WITH_CUDA=OFF)
  # Built first, tested once the image test is done: its timed tests must
  # not share the cores with the image's compile either.
  cmake -S . -B build-san -DLAYERCAST_WERROR=ON "${san_flags[@]}" >/dev/null
  cmake --build build-san -j"$jobs"
  image_status=0
  wait "$image_pid" || image_status=$?
  image_pid=
  stage_done "build build-san, image test beside it"
  echo "== image test done at ${SECONDS}s"
  cat "$image_log"
  [ "$image_status" = 0 ] || exit 1
  run_suite build-san "" "" "${san_flags[@]}"
  # No ThreadSanitizer stage: Debian's abseil is not built with TSan, so TSan
  # cannot see absl::Mutex and reports every absl::Mutex-guarded field as a
  # race (tried: 139 such reports in the concurrency tests). The label
  # `concurrency` marks the tests to run under TSan with an instrumented
  # abseil: LAYERCAST_SANITIZE=thread, ctest -L concurrency.
  LAYERCAST_FUZZ_BUILD=build-san tests/fuzz/run_fuzzers.sh "${LAYERCAST_FUZZ_SECONDS:-45}"
  stage_done "fuzzers"
fi
