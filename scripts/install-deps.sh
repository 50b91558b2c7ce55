#!/usr/bin/env bash
# Installs what layercast needs on Debian bookworm. Idempotent: safe to run
# again. Needs root (or sudo).
#   scripts/install-deps.sh                everything: build, every test, and the image test's tools
#   scripts/install-deps.sh --build-only   only what compiling layercast-shard and layercast needs
#                                          (the Dockerfile's build stage: no tests, bench, Python)
#   scripts/install-deps.sh --image-tools  only podman and debootstrap (tests/deploy/image_test.sh)
set -euo pipefail

# Compiling the two binaries with tests, benchmarks and the Python package
# off: the top-level CMakeLists.txt's find_package()s and proto/'s health
# stubs (grpc-proto). gRPC's CMake config needs protobuf-compiler-grpc.
build_packages=(
  g++ cmake ninja-build
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  prometheus-cpp-dev libboost-dev nlohmann-json3-dev libssl-dev libspdlog-dev
)
test_packages=(
  build-essential pkg-config clang clang-format
  ccache    # the test builds compile through it (CMakeLists.txt): a rebuild compiles what changed
  libclang-rt-14-dev  # libFuzzer and the sanitizer runtimes for clang (tests/fuzz)
  libgtest-dev libgmock-dev libbenchmark-dev libeigen3-dev
  openssl  # the command: tests/integration/security_test makes its certificates with it
  python3 python3-torch python3-numpy
  python3-dev pybind11-dev libdlpack-dev python3-pytest  # the Python package (python/) and its tests
  prometheus  # promtool and the server for tests/observability, which runs its own instance
  yamllint  # tests/deploy; kubectl, node and npm come with the machine image
  curl      # tests/deploy/image_test.sh reads /metrics with it
)
# tests/deploy/image_test.sh: podman builds the image (as root, --isolation
# chroot, vfs storage: no uidmap, fuse-overlayfs or slirp4netns needed);
# debootstrap makes its Debian base images, verified with the archive's keys.
image_packages=(podman debootstrap debian-archive-keyring)

case "${1:-}" in
  "") packages=("${build_packages[@]}" "${test_packages[@]}" "${image_packages[@]}") what="build and test" ;;
  --build-only) packages=("${build_packages[@]}") what="build" ;;
  --image-tools) packages=("${image_packages[@]}") what="image test" ;;
  *)
    echo "usage: $0 [--build-only | --image-tools]" >&2
    exit 2
    ;;
esac

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing: ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "all $what dependencies are installed"
fi
