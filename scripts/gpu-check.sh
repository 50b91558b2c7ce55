#!/usr/bin/env bash
# The GPU checks of issue 9 in one bounded run, for a machine with a GPU and
# the same Debian + CUDA toolkit image as CI (docs/gpu.md):
#   1. dependencies: the Debian build packages, if missing, from the .deb
#      files carried in build-gpu-debs/ (the device machine reaches no package
#      mirror; make them here with --prepare-debs), else with apt. Only what the
#      build needs: scripts/install-deps.sh also pulls PyTorch and Prometheus;
#   2. configure build-gpu with -DLAYERCAST_WITH_CUDA=ON and build only the GPU
#      tests and benchmark (and what they link);
#   3. the GPU tests (ctest -L gpu): device bytes bit-identical to the host
#      gather, the device budget against cudaMemGetInfo, NCCL with K = 1 (and
#      K > 1 when there are several GPUs), NCCL set-up that cannot complete;
#   4. bench/gpu/gpu_landing_bench: landing throughput against plain pinned
#      cudaMemcpy, and a forward/backward walk with simulated compute.
# Every stage runs under `timeout`; the whole run stops before
# GPU_CHECK_SECONDS (default 450 s). Logs go to build-gpu/gpu-check/ and, when
# $OUT is set, are copied there. Exit 0 only if every stage passed on a
# machine with a visible GPU.
#
# On the device machine: run(command='bash scripts/gpu-check.sh',
#                            carry=['build-gpu-debs'], timeout_s=540)
#
# Or, when the device's image is not Debian's (its own libraries differ from
# the ones the .deb files expect) or its time is short: build here and carry
# the programs. `scripts/gpu-check.sh --prepare-prebuilt` builds the GPU tests,
# the benchmark and layercast-shard in build/ (configured with CUDA, as the
# default AUTO does where nvcc is on the PATH) and puts stripped copies, with
# the non-system libraries they load, in build-gpu-prebuilt/ (~26 MB). Then
# steps 1 and 2 are skipped there: run(command='bash scripts/gpu-check.sh',
# carry=['build-gpu-prebuilt'], timeout_s=300). CUDA's runtime and NCCL come
# from the device's own installation (its toolkit, else its Python packages).
set -uo pipefail
cd "$(dirname "$0")/.."

# --prepare-debs (run where apt works, e.g. the development machine): puts in
# build-gpu-debs/ the .deb files of the build packages that a fresh image of
# this machine lacks (gRPC, protobuf, prometheus-cpp and Boost development
# files, ~19 MB), from apt's cache or downloaded.
if [ "${1:-}" = "--prepare-debs" ]; then
  set -e
  debs=(civetweb grpc-proto libabsl-dev libboost-dev libboost1.74-dev libc-ares-dev libcivetweb-dev
        libcivetweb1 libcurl4-openssl-dev libgrpc++-dev libgrpc-dev libprometheus-cpp-core1.0
        libprometheus-cpp-pull1.0 libprometheus-cpp-push1.0 libprotobuf-dev libprotobuf-lite32
        libre2-dev nlohmann-json3-dev prometheus-cpp-dev protobuf-compiler protobuf-compiler-grpc)
  mkdir -p build-gpu-debs
  for p in "${debs[@]}"; do
    version=$(dpkg-query -W -f='${Version}' "$p" 2>/dev/null || true)
    cached=$(ls /var/cache/apt/archives/"${p}"_*.deb 2>/dev/null | head -1 || true)
    if [ -n "$cached" ]; then
      cp "$cached" build-gpu-debs/
    else
      (cd build-gpu-debs && apt-get download "$p${version:+=$version}")
    fi
  done
  du -sh build-gpu-debs
  echo "carry build-gpu-debs with the run: run(command='bash scripts/gpu-check.sh', carry=['build-gpu-debs'])"
  exit 0
fi

# --prepare-prebuilt [BUILD_DIR] (run here): see the header. The tests find
# layercast-shard and nccl_rank_helper at the absolute paths they were built
# with; paths.txt records them so that the run there links them in place.
readonly prebuilt=build-gpu-prebuilt
if [ "${1:-}" = "--prepare-prebuilt" ]; then
  set -e
  from=${2:-build}
  cmake --build "$from" -j"$(nproc)" --target gpu_test nccl_rank_helper gpu_landing_bench \
    layercast-shard
  rm -rf "$prebuilt" && mkdir -p "$prebuilt/bin" "$prebuilt/lib"
  : >"$prebuilt/paths.txt"
  for target in tests/gpu/gpu_test tests/gpu/nccl_rank_helper bench/gpu/gpu_landing_bench \
                bin/layercast-shard; do
    built=$(realpath "$from/$target")
    strip -o "$prebuilt/bin/$(basename "$built")" "$built"
    echo "$(basename "$built") $built" >>"$prebuilt/paths.txt"
  done
  # glibc and the C++ runtime are the device's own (newer there); CUDA's
  # runtime, NCCL and the driver must match the device's driver.
  ldd "$prebuilt"/bin/* | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcuda|libcudart|libnccl)\.so' |
    xargs -I{} cp -L {} "$prebuilt/lib/"
  du -sh "$prebuilt"
  echo "carry $prebuilt with the run: run(command='bash scripts/gpu-check.sh'," \
       "carry=['$prebuilt'], timeout_s=300)"
  exit 0
fi

readonly total_seconds=${GPU_CHECK_SECONDS:-450}
readonly start=$(date +%s)
readonly deadline=$((start + total_seconds))
readonly build_dir=build-gpu
readonly logs=$build_dir/gpu-check
readonly jobs=$(nproc)
mkdir -p "$logs"
summary=()
failed=0

stamp() { echo "== [$(date -u +%H:%M:%S) +$(($(date +%s) - start))s] $*"; }

copy_logs() {
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" && cp -r "$logs"/. "$OUT"/ 2>/dev/null || true
  fi
}
trap copy_logs EXIT

# run_stage NAME LIMIT_SECONDS COMMAND...: runs COMMAND under `timeout` for at
# most LIMIT seconds and never past the overall deadline; output to the
# terminal and to $logs/NAME.log. Returns the command's status (124: timeout).
run_stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - $(date +%s)))
  if [ "$left" -lt 10 ]; then
    stamp "$name: not run, the ${total_seconds} s budget is spent"
    summary+=("$name: NOT RUN (time budget spent)")
    failed=1
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  stamp "$name (at most ${limit} s)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  local rc=${PIPESTATUS[0]}
  local took=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    summary+=("$name: ok (${took} s)")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    summary+=("$name: TIMED OUT after ${took} s (limit ${limit} s)")
    failed=1
  else
    summary+=("$name: FAILED with status $rc (${took} s)")
    failed=1
  fi
  stamp "$name: status $rc after ${took} s"
  return "$rc"
}

finish() {
  stamp "summary"
  printf '  %s\n' "${summary[@]}" | tee "$logs/summary.txt"
  exit "$failed"
}

stamp "gpu-check on $(hostname), $(nproc) cores, deadline ${total_seconds} s"
{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi
  else
    echo "nvidia-smi: not found (no NVIDIA driver?)"
  fi
  command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc: not on the PATH"
} 2>&1 | tee "$logs/nvidia-smi.log"
gpu_visible=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  gpu_visible=1
else
  summary+=("gpu: NONE VISIBLE (nvidia-smi -L lists no GPU): GPU tests will skip")
  failed=1
fi

# Build dependencies: what CMakeLists.txt finds, nothing more. The device
# machine cannot reach a package mirror, so the Debian packages its image
# lacks travel with the working tree as .deb files in build-gpu-debs/ (ignored
# by git; made here with --prepare-debs, carried with the run's `carry`).
deps() {
  local packages=(cmake g++ make libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev
                  protobuf-compiler grpc-proto prometheus-cpp-dev libboost-dev libgtest-dev
                  libgmock-dev libbenchmark-dev nlohmann-json3-dev libssl-dev)
  local missing=() p
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    echo "all build dependencies are installed"
    return 0
  fi
  echo "missing: ${missing[*]}"
  if compgen -G "build-gpu-debs/*.deb" >/dev/null; then
    echo "installing the carried packages in build-gpu-debs/: $(ls build-gpu-debs | wc -l) files"
    dpkg -i --force-depends build-gpu-debs/*.deb >/dev/null || {
      echo "dpkg -i failed; unpacking the files instead"
      for f in build-gpu-debs/*.deb; do dpkg -x "$f" /; done
    }
    ldconfig
    return 0
  fi
  local sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo -n)
  if ! timeout 30 "${sudo_cmd[@]}" apt-get update -q; then
    echo "apt-get update failed or took over 30 s: no package mirror is reachable, so the" \
         "missing packages above cannot be installed. Make build-gpu-debs/ where apt works" \
         "(scripts/gpu-check.sh --prepare-debs) and carry it with the run." >&2
    return 1
  fi
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
}
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
# The carried programs: each one's libraries found (the carried ones first,
# then CUDA's runtime and NCCL wherever the device keeps them), and the
# absolute paths the tests start them from linked to the carried copies.
use_prebuilt() {
  local dirs=("$PWD/$prebuilt/lib") found
  for found in $(timeout 30 find /usr/local/cuda/ /opt /usr/lib /usr/local/lib -maxdepth 8 \
                   \( -name 'libnccl.so.2' -o -name 'libcudart.so.13' \) 2>/dev/null); do
    dirs+=("$(dirname "$found")")
  done
  local joined
  joined=$(IFS=:; echo "${dirs[*]}")
  export LD_LIBRARY_PATH=$joined${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  local name path
  while read -r name path; do
    [ "$path" -ef "$prebuilt/bin/$name" ] && continue
    if [ -e "$path" ] && [ ! -L "$path" ]; then
      echo "$path exists and is not a link: not replacing it with the carried $name" >&2
      return 1
    fi
    mkdir -p "$(dirname "$path")" && ln -sfn "$PWD/$prebuilt/bin/$name" "$path" || return 1
  done <"$prebuilt/paths.txt"
  ldd "$prebuilt"/bin/* | tee "$logs/ldd.log"
  ! grep -q 'not found' "$logs/ldd.log"
}

if [ -f "$prebuilt/paths.txt" ]; then
  stamp "carried programs in $prebuilt/: no dependencies to install, nothing to build"
  if use_prebuilt; then
    summary+=("libraries: every carried program finds its libraries")
  else
    summary+=("libraries: A CARRIED PROGRAM MISSES ONE (see ldd.log)")
    failed=1
  fi
  # One process per test, as ctest runs them: the budget test reads the
  # device-wide cudaMemGetInfo, which other tests' contexts would move.
  each_test() {
    local binary=$1 suite="" line list status=0 ran=0
    list=$("$binary" --gtest_list_tests) || { echo "$binary --gtest_list_tests failed" >&2; return 1; }
    while IFS= read -r line; do
      case "$line" in
        " "*) echo "== ${suite}${line##* }"
              ran=$((ran + 1))
              timeout --kill-after=5 90 "$binary" --gtest_color=no \
                --gtest_filter="${suite}${line##* }" || status=1 ;;
        *) suite=${line%% *} ;;
      esac
    done < <(sed 's/  *#.*//' <<<"$list")
    echo "ran $ran tests, each in its own process"
    [ "$ran" -gt 0 ] || { echo "$binary lists no tests" >&2; return 1; }
    return "$status"
  }
  readonly gpu_test_cmd=(bash -c "$(declare -f each_test); each_test $prebuilt/bin/gpu_test")
  readonly bench_cmd=("$prebuilt/bin/gpu_landing_bench" --require-gpu)
else
  run_stage deps 200 bash -c "$(declare -f deps); deps" || finish

  run_stage configure 90 cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DLAYERCAST_WITH_CUDA=ON -DLAYERCAST_BUILD_TESTS=ON -DLAYERCAST_BUILD_BENCH=ON || finish

  run_stage build 240 cmake --build "$build_dir" -j"$jobs" \
    --target gpu_test nccl_rank_helper gpu_landing_bench || finish
  readonly gpu_test_cmd=(ctest --test-dir "$build_dir" -L gpu --output-on-failure --timeout 90
                         -j1 -V)
  readonly bench_cmd=("$build_dir/bench/gpu/gpu_landing_bench" --require-gpu)
fi

# Serially: the budget test reads device-wide cudaMemGetInfo.
run_stage gpu-tests 240 "${gpu_test_cmd[@]}"
if [ -f "$logs/gpu-tests.log" ]; then
  # Each skipped test's reason: the line after gtest's "FILE:LINE: Skipped"
  # (printed the same under ctest and when the tests run one by one).
  grep -A1 ': Skipped$' "$logs/gpu-tests.log" | grep -v -e '^--$' -e ': Skipped$' \
    > "$logs/skipped.txt" || true
  echo "skipped tests and why:"
  cat "$logs/skipped.txt"
fi

run_stage gpu-bench 120 "${bench_cmd[@]}"

{
  echo "== nvidia-smi after the run"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total \
    --format=csv
} 2>&1 | tee -a "$logs/nvidia-smi.log"
[ "$gpu_visible" -eq 1 ] || echo "no GPU was visible: the GPU checks above skipped" >&2
finish
