#!/usr/bin/env python3
"""Trains a small CNN with BatchNorm and dropout through layercast, checks
each step's loss against the same model trained in plain PyTorch, bit for
bit, and exports the trained fp32 model as safetensors.

Nothing here is Llama-shaped: module paths name the tensors
("blocks.0.conv.weight", "head.weight"), the shards group them into layers
with --layer-regex, BatchNorm's running statistics stay with the worker
(never on the shards), and dropout draws the same masks in the backward
pass's recomputation as in the forward pass (layercast.torch restores the
random state per stage, as torch.utils.checkpoint does).

    # 1. the initial weights, as a safetensors file the shards serve
    PYTHONPATH=build/python /usr/bin/python3 examples/cnn_train.py init /tmp/cnn
    # 2. two training shards (in two shells, or with &)
    build/bin/layercast-shard --model /tmp/cnn --shard-index 0 --num-shards 2 \\
        --listen 127.0.0.1:7070 --layer-regex '^blocks\\.(\\d+)\\.' --first-layer-prefix '' \\
        --optimizer adamw:lr=1e-2,weight_decay=0.01 --policy 'p=f32,c=bf16,o=f32;*bn*=f32'
    build/bin/layercast-shard ... --shard-index 1 ... --listen 127.0.0.1:7071 ...
    # 3. the worker: trains, compares with plain PyTorch, exports
    PYTHONPATH=build/python /usr/bin/python3 examples/cnn_train.py train \\
        --shards 127.0.0.1:7070,127.0.0.1:7071 --steps 30 --export /tmp/cnn-trained.safetensors

examples/cnn_train.sh does all three with the build tree's binaries.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import layercast
import layercast.torch

CLASSES = 4
LR, WEIGHT_DECAY = 1e-2, 0.01
OPTIMIZER = f"adamw:lr={LR},weight_decay={WEIGHT_DECAY}"
# bfloat16 compute; BatchNorm's weights in float32, as autocast runs it.
POLICY = "p=f32,c=bf16,o=f32;*bn*=f32"
SHARD_FLAGS = ["--policy", POLICY, "--optimizer", OPTIMIZER,
               "--layer-regex", r"^blocks\.(\d+)\.", "--first-layer-prefix", ""]
DROPOUT = 0.1


class Block(nn.Module):
    """3x3 convolution, BatchNorm (in float32), ReLU, dropout."""

    def __init__(self, channels_in: int, channels_out: int, device=None):
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False, device=device)
        self.bn = nn.BatchNorm2d(channels_out, device=device)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.dropout(F.relu(self.bn(y.float()))).to(y.dtype)


class Net(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.blocks = nn.ModuleList([Block(1, 8, device), Block(8, 8, device),
                                     Block(8, 16, device)])
        self.head = nn.Linear(16, CLASSES, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _, fn in self.stages():
            x = fn(x)
        return x

    def stages(self) -> List[Tuple[str, object]]:
        """(layercast layer, fn) in forward order: the shards' layers are
        "blocks.0" to "blocks.2", and "final" for the head (the tensors no
        block claims)."""
        return [(f"blocks.{i}", block) for i, block in enumerate(self.blocks)] + [
            ("final", lambda x: self.head(x.mean(dim=(2, 3))))]


def batch(step: int, size: int = 16) -> Tuple[torch.Tensor, torch.Tensor]:
    """8x8 images, noise plus a bright 2x2 spot in one of four quadrants;
    the class is the quadrant."""
    g = torch.Generator().manual_seed(1000 + step)
    labels = torch.randint(0, CLASSES, (size,), generator=g)
    images = 0.3 * torch.randn(size, 1, 8, 8, generator=g)
    for i, label in enumerate(labels.tolist()):
        row, col = 4 * (label // 2) + 1, 4 * (label % 2) + 1
        images[i, 0, row:row + 2, col:col + 2] += 2.0
    return images, labels


def initial_weights(seed: int = 7) -> Dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {name: t.detach().clone() for name, t in Net().named_parameters()}


def fresh_buffers() -> Dict[str, torch.Tensor]:
    """A new model's BatchNorm statistics (zeros, ones and a count)."""
    return dict(Net().named_buffers())


def train(shard_set, steps: int, seed: int = 0, log=print) -> Tuple[List[float], Net]:
    """Trains through the shards; returns the losses and the worker's model
    (its buffers hold the running statistics)."""
    model = Net(device="meta")
    model.train()
    trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(),
                                               buffers=fresh_buffers())
    torch.manual_seed(seed)  # dropout's masks
    losses = []
    for step in range(steps):
        losses.append(trainer.train_step(*batch(step), F.cross_entropy))
        log(f"step {step:3d}  loss {losses[-1]:.6f}")
    return losses, model


def reference(weights: Dict[str, torch.Tensor], steps: int, seed: int = 0,
              micro: int = 1) -> Tuple[List[float], Dict[str, torch.Tensor], Net]:
    """Plain PyTorch as the shards' policy says: an fp32 master, a bfloat16
    copy of it each step (BatchNorm's float32), inputs cast to bfloat16 and
    the output to float32, torch.optim.AdamW(foreach=False) on the master.
    With `micro` > 1, each step accumulates that many batches' gradients
    (each loss divided by `micro`) in the copy's .grad, as PyTorch does."""
    model = Net()
    model.load_state_dict(fresh_buffers(), strict=False)
    model.train()
    masters = {name: t.clone() for name, t in weights.items()}
    optimizer = torch.optim.AdamW(list(masters.values()), lr=LR, weight_decay=WEIGHT_DECAY,
                                  foreach=False)
    torch.manual_seed(seed)
    losses = []
    for step in range(steps):
        compute = {n: (m.clone() if ".bn." in n else m.to(torch.bfloat16)).requires_grad_()
                   for n, m in masters.items()}
        for m in range(micro):
            inputs, targets = batch(step * micro + m)
            with layercast.torch.bound(model, compute):
                loss = F.cross_entropy(model(inputs.to(torch.bfloat16)).float(), targets) / micro
                loss.backward()
            losses.append(loss.item())
        for name, master in masters.items():
            master.grad = compute[name].grad.float()
        optimizer.step()
    return losses, masters, model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="write the initial weights for the shards")
    init.add_argument("directory", type=pathlib.Path)
    run = commands.add_parser("train", help="train through the shards, compare, export")
    run.add_argument("--shards", required=True, help="host:port,... in shard order")
    run.add_argument("--steps", type=int, default=30)
    run.add_argument("--export", type=pathlib.Path, help="write the trained model here")
    args = parser.parse_args()

    if args.command == "init":
        args.directory.mkdir(parents=True, exist_ok=True)
        layercast.torch.save_safetensors(args.directory / "model.safetensors", initial_weights())
        print(f"wrote {args.directory / 'model.safetensors'}")
        return 0

    with layercast.connect(args.shards) as shard_set:
        if shard_set.version() != 0:
            print("the shards have trained already: start them afresh from `init`'s weights",
                  file=sys.stderr)
            return 1
        losses, model = train(shard_set, args.steps)
        want_losses, want_masters, want_model = reference(initial_weights(), args.steps)
        same = losses == want_losses
        print(f"losses {losses[0]:.4f} -> {losses[-1]:.4f}; plain PyTorch's, bit for bit: "
              f"{'yes' if same else 'NO'}")
        buffers_same = all(torch.equal(a, b) for a, b in
                           zip(model.buffers(), want_model.buffers()))
        print(f"BatchNorm running statistics equal plain PyTorch's: "
              f"{'yes' if buffers_same else 'NO'}")
        if args.export is None:
            return 0 if same and buffers_same else 1
        exported = shard_set.export(str(args.export))
        weights = layercast.torch.load_safetensors(args.export)
        weights_same = weights.keys() == want_masters.keys() and all(
            torch.equal(weights[n].view(torch.int32), want_masters[n].view(torch.int32))
            for n in weights)
        print(f"exported {exported['tensors']} tensors at version {exported['version']} to "
              f"{', '.join(exported['files'])}; equal to plain PyTorch's fp32 master: "
              f"{'yes' if weights_same else 'NO'}")
        # The whole model back in plain PyTorch: the export plus the buffers.
        trained = Net()
        trained.load_state_dict({**weights, **dict(model.named_buffers())})
        trained.eval()
        images, labels = batch(10_000, size=256)
        accuracy = (trained(images).argmax(dim=1) == labels).float().mean().item()
        print(f"the exported model in plain PyTorch: {accuracy:.0%} right on 256 new images")
        return 0 if same and buffers_same and weights_same else 1


if __name__ == "__main__":
    sys.exit(main())
