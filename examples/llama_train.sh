#!/usr/bin/env bash
# Trains examples/llama_train.py's model through two local training shards
# with two worker processes, from the build tree: writes the initial weights,
# starts the shards on 127.0.0.1, trains, and stops the shards (SIGTERM: they
# checkpoint their fp32 master and AdamW state to a temporary folder).
# Usage: examples/llama_train.sh [--steps N]   (build first: cmake --build build)
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
/usr/bin/python3 examples/llama_train.py init "$work/model"
mkdir -p "$work/checkpoints"
for i in 0 1; do
  "$shard" --model "$work/model" --shard-index $i --num-shards 2 --listen 127.0.0.1:0 \
    --port-file "$work/port-$i" --checkpoint-dir "$work/checkpoints" \
    --optimizer "adamw:lr=3e-3,weight_decay=0.1;*norm*:weight_decay=0" \
    --data-parallel-workers 2 --policy "p=f32,c=bf16;*norm*=f32" 2> "$work/shard-$i.log" &
  pids+=($!)
done
for i in 0 1; do
  for _ in $(seq 600); do [ -s "$work/port-$i" ] && break; sleep 0.1; done
  [ -s "$work/port-$i" ] || { echo "shard $i did not start: see $work/shard-$i.log" >&2; exit 1; }
done
shards="127.0.0.1:$(cat "$work/port-0"),127.0.0.1:$(cat "$work/port-1")"
/usr/bin/python3 examples/llama_train.py train --shards "$shards" \
  --workers 2 "$@"
echo "checkpoints (fp32 master and AdamW state): $work/checkpoints"
