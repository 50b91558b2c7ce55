#!/usr/bin/env bash
# Trains examples/cnn_train.py's CNN through two local training shards, from
# the build tree: writes the initial weights, starts the shards on 127.0.0.1,
# trains (checking each loss against plain PyTorch), exports the trained
# fp32 model, and stops the shards.
# Usage: examples/cnn_train.sh [--steps N]   (build first: cmake --build build --target programs)
. "$(dirname "$0")/local_shards.sh"
/usr/bin/python3 examples/cnn_train.py init "$work/model"
start_shards 2 --model "$work/model" --layer-regex '^blocks\.(\d+)\.' --first-layer-prefix '' \
  --optimizer "adamw:lr=1e-2,weight_decay=0.01" --policy 'p=f32,c=bf16,o=f32;*bn*=f32'
/usr/bin/python3 examples/cnn_train.py train --shards "$shards" \
  --export "$work/cnn-trained.safetensors" "$@"
