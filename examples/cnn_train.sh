#!/usr/bin/env bash
# Trains examples/cnn_train.py's CNN through two local training shards, from
# the build tree: writes the initial weights, starts the shards on 127.0.0.1,
# trains (checking each loss against plain PyTorch), exports the trained
# fp32 model, and stops the shards.
# Usage: examples/cnn_train.sh [--steps N]   (build first: cmake --build build)
set -euo pipefail
cd "$(dirname "$0")/.."
shard=build/bin/layercast-shard
[ -x "$shard" ] && [ -d build/python/layercast ] || {
  echo "build first: cmake -S . -B build && cmake --build build -j2" >&2; exit 1; }
work=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
export PYTHONPATH=build/python
/usr/bin/python3 examples/cnn_train.py init "$work/model"
for i in 0 1; do
  "$shard" --model "$work/model" --shard-index $i --num-shards 2 --listen 127.0.0.1:0 \
    --port-file "$work/port-$i" --layer-regex '^blocks\.(\d+)\.' --first-layer-prefix '' \
    --optimizer "adamw:lr=1e-2,weight_decay=0.01" --policy 'p=f32,c=bf16,o=f32;*bn*=f32' \
    2> "$work/shard-$i.log" &
  pids+=($!)
done
for i in 0 1; do
  for _ in $(seq 600); do [ -s "$work/port-$i" ] && break; sleep 0.1; done
  [ -s "$work/port-$i" ] || { echo "shard $i did not start: see $work/shard-$i.log" >&2; exit 1; }
done
/usr/bin/python3 examples/cnn_train.py train \
  --shards "127.0.0.1:$(cat "$work/port-0"),127.0.0.1:$(cat "$work/port-1")" \
  --export "$work/cnn-trained.safetensors" "$@"
