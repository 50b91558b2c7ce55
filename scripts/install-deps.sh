#!/usr/bin/env bash
# Installs everything layercast needs to build and test on Debian bookworm.
# Idempotent: safe to run again. Needs root (or sudo).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config clang clang-format
  libclang-rt-14-dev  # libFuzzer and the sanitizer runtimes for clang (tests/fuzz)
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  prometheus-cpp-dev libboost-dev libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libeigen3-dev libssl-dev libspdlog-dev
  openssl  # the command: tests/integration/security_test makes its certificates with it
  python3 python3-torch python3-numpy
  python3-dev pybind11-dev libdlpack-dev python3-pytest  # the Python package (python/) and its tests
  prometheus  # promtool and the server for tests/observability, which runs its own instance
  yamllint  # tests/deploy; kubectl, node and npm come with the machine image
)

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
  echo "all build and test dependencies are installed"
fi
