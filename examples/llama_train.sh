#!/usr/bin/env bash
# Trains examples/llama_train.py's model through two local training shards
# with two worker processes, from the build tree: writes the initial weights,
# starts the shards on 127.0.0.1, trains, and stops the shards (SIGTERM: they
# checkpoint their fp32 master and AdamW state to a temporary folder).
# Usage: examples/llama_train.sh [--steps N]   (build first: cmake --build build --target programs)
. "$(dirname "$0")/local_shards.sh"
/usr/bin/python3 examples/llama_train.py init "$work/model"
mkdir -p "$work/checkpoints"
start_shards 2 --model "$work/model" --checkpoint-dir "$work/checkpoints" \
  --optimizer "adamw:lr=3e-3,weight_decay=0.1;*norm*:weight_decay=0" \
  --data-parallel-workers 2 --policy "p=f32,c=bf16;*norm*=f32"
/usr/bin/python3 examples/llama_train.py train --shards "$shards" --workers 2 "$@"
echo "checkpoints (fp32 master and AdamW state): $work/checkpoints"
