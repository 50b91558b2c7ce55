#!/usr/bin/env bash
# Every test: installs what is missing, checks formatting, builds with
# warnings as errors and runs the whole suite; then again under
# AddressSanitizer + UndefinedBehaviorSanitizer.
# LAYERCAST_SKIP_SANITIZERS=1 runs only the plain build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc)

echo "== clang-format"
sources=$(git ls-files '*.cc' '*.h' 2>/dev/null || find core server client tests bench -name '*.cc' -o -name '*.h')
clang-format --dry-run --Werror $sources

run_suite() {
  local dir=$1; shift
  echo "== build $dir ($*)"
  cmake -S . -B "$dir" -DLAYERCAST_WERROR=ON "$@" >/dev/null
  cmake --build "$dir" -j"$jobs"
  echo "== test $dir"
  ctest --test-dir "$dir" --output-on-failure --timeout 600 -j"$jobs"
}

run_suite build -DCMAKE_BUILD_TYPE=RelWithDebInfo
if [ "${LAYERCAST_SKIP_SANITIZERS:-0}" != 1 ]; then
  run_suite build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLAYERCAST_SANITIZE=address,undefined \
    -DLAYERCAST_BUILD_BENCH=OFF
fi
