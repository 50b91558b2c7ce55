#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs `layercast demo`:
# local shard servers on 127.0.0.1 with a built-in synthetic Llama-shaped
# model, and a worker walking every layer forward then backward.
# Extra arguments go to `layercast demo` (e.g. --num-shards 4).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target layercast layercast-shard
exec build/bin/layercast demo "$@"
