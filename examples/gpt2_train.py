#!/usr/bin/env python3
"""Trains a small GPT-2-shaped model through layercast: tied embeddings
(`lm_head.weight` is `transformer.wte.weight`), learned positions, dropout,
a causal-mask buffer, Hugging Face's GPT-2 tensor names. Checks each step's
loss against the same model trained in plain PyTorch with
torch.optim.AdamW, bit for bit, and exports the trained model.

The shards hold the tied tensor once (`transformer.wte.weight`, in the
first layer, beside `transformer.wpe.weight`); the last stage, which uses
it as `lm_head.weight`, gathers that layer too, and its gradient is the sum
of both uses, as in one autograd graph.

    # 1. the initial weights, as a safetensors file the shards serve
    PYTHONPATH=build/python /usr/bin/python3 examples/gpt2_train.py init /tmp/gpt2
    # 2. two training shards (in two shells, or with &)
    build/bin/layercast-shard --model /tmp/gpt2 --shard-index 0 --num-shards 2 \\
        --listen 127.0.0.1:7070 --layer-regex '^transformer\\.h\\.(\\d+)\\.' \\
        --first-layer-prefix 'transformer.w' --optimizer adamw:lr=1e-2,weight_decay=0.01 \\
        --policy 'p=f32,c=f32,o=f32'
    build/bin/layercast-shard ... --shard-index 1 ... --listen 127.0.0.1:7071 ...
    # 3. the worker: trains, compares with plain PyTorch, exports
    PYTHONPATH=build/python /usr/bin/python3 examples/gpt2_train.py train \\
        --shards 127.0.0.1:7070,127.0.0.1:7071 --steps 30 --export /tmp/gpt2-trained.safetensors

examples/gpt2_train.sh does all three with the build tree's binaries.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import layercast
import layercast.torch

VOCAB, CONTEXT, WIDTH, HEADS, BLOCKS = 48, 16, 32, 4, 2
LR, WEIGHT_DECAY = 1e-2, 0.01
OPTIMIZER = f"adamw:lr={LR},weight_decay={WEIGHT_DECAY}"
# float32 throughout: the comparison is with plain PyTorch, no casts.
POLICY = "p=f32,c=f32,o=f32"
SHARD_FLAGS = ["--policy", POLICY, "--optimizer", OPTIMIZER,
               "--layer-regex", r"^transformer\.h\.(\d+)\.", "--first-layer-prefix",
               "transformer.w"]
DROPOUT = 0.1


class Attention(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH, device=device)
        self.c_proj = nn.Linear(WIDTH, WIDTH, device=device)
        self.dropout = nn.Dropout(DROPOUT)
        # A buffer, as Hugging Face's GPT-2 keeps its causal mask.
        self.register_buffer("bias", torch.tril(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool,
                                                           device=device)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        q, k, v = (t.view(batch, length, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(WIDTH // HEADS)
        scores = scores.masked_fill(~self.bias[:length, :length], float("-inf"))
        y = self.dropout(scores.softmax(dim=-1)) @ v
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, WIDTH))


class MLP(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH, device=device)
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH, device=device)
        self.attn = Attention(device)
        self.ln_2 = nn.LayerNorm(WIDTH, device=device)
        self.mlp = MLP(device)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class Transformer(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH, device=device)
        self.wpe = nn.Embedding(CONTEXT, WIDTH, device=device)
        self.drop = nn.Dropout(DROPOUT)
        self.h = nn.ModuleList([Block(device) for _ in range(BLOCKS)])
        self.ln_f = nn.LayerNorm(WIDTH, device=device)


class GPT(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.transformer = Transformer(device)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False, device=device)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT-2 ties them

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        t = self.transformer
        return t.drop(t.wte(tokens) + t.wpe(positions))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for _, fn in self.stages():
            x = fn(x)
        return x

    def stages(self) -> List[Tuple[str, object]]:
        """(layercast layer, fn) in forward order: "transformer.w" (wte and
        wpe, --first-layer-prefix transformer.w), "transformer.h.N", and
        "final" (ln_f; lm_head is wte's tensor, gathered from the first)."""
        t = self.transformer
        return ([("transformer.w", self.embed)] +
                [(f"transformer.h.{i}", block) for i, block in enumerate(t.h)] +
                [("final", lambda x: self.lm_head(t.ln_f(x)))])


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int, size: int = 8) -> Tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences modulo VOCAB (a random start and stride per
    row); the target is the next token."""
    g = torch.Generator().manual_seed(2000 + step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    tokens = (start + stride * torch.arange(CONTEXT + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def initial_state(seed: int = 3) -> Dict[str, torch.Tensor]:
    """A new model's state_dict(): the tied tensor under both its names."""
    torch.manual_seed(seed)
    model = GPT()
    with torch.no_grad():  # GPT-2's initialisation: small embeddings, logits near zero
        model.transformer.wte.weight.normal_(std=0.02)
        model.transformer.wpe.weight.normal_(std=0.01)
    return model.state_dict()


def fresh_buffers() -> Dict[str, torch.Tensor]:
    return dict(GPT().named_buffers())


def train(shard_set, steps: int, seed: int = 0, log=print) -> Tuple[List[float], GPT]:
    """Trains through the shards; returns the losses and the worker's model."""
    model = GPT(device="meta")
    model.train()
    trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(),
                                               buffers=fresh_buffers())
    torch.manual_seed(seed)  # dropout's masks
    losses = []
    for step in range(steps):
        losses.append(trainer.train_step(*batch(step), loss_fn))
        log(f"step {step:3d}  loss {losses[-1]:.6f}")
    return losses, model


def reference(state: Dict[str, torch.Tensor], steps: int,
              seed: int = 0) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """Plain PyTorch: the model loaded from `state`, torch.optim.AdamW
    (foreach=False) over its parameters. Returns the losses and the
    trained parameters (named_parameters(): the tied one once)."""
    model = GPT()
    model.load_state_dict(state)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                  foreach=False)
    torch.manual_seed(seed)
    losses = []
    for step in range(steps):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


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
        # state_dict() names the tied tensor twice; it is written once.
        layercast.torch.save_safetensors(args.directory / "model.safetensors", initial_state())
        print(f"wrote {args.directory / 'model.safetensors'}")
        return 0

    with layercast.connect(args.shards) as shard_set:
        if shard_set.version() != 0:
            print("the shards have trained already: start them afresh from `init`'s weights",
                  file=sys.stderr)
            return 1
        losses, model = train(shard_set, args.steps)
        want_losses, want = reference(initial_state(), args.steps)
        same = losses == want_losses
        print(f"losses {losses[0]:.4f} -> {losses[-1]:.4f}; plain PyTorch's, bit for bit: "
              f"{'yes' if same else 'NO'}")
        if args.export is None:
            return 0 if same else 1
        exported = shard_set.export(str(args.export))
        weights = layercast.torch.load_safetensors(args.export)
        weights_same = weights.keys() == want.keys() and all(
            torch.equal(weights[n].view(torch.int32), want[n].view(torch.int32)) for n in want)
        print(f"exported {exported['tensors']} tensors at version {exported['version']} to "
              f"{', '.join(exported['files'])}; equal to plain PyTorch's parameters: "
              f"{'yes' if weights_same else 'NO'}")
        # Back into plain PyTorch, with the worker's buffers (the masks):
        # lm_head.weight is not in the file (it is wte's tensor), so
        # strict=False, and the tie fills it.
        trained = GPT()
        missing = trained.load_state_dict({**weights, **dict(model.named_buffers())},
                                          strict=False).missing_keys
        assert missing == ["lm_head.weight"], missing
        trained.eval()
        inputs, targets = batch(10_000, size=64)
        with torch.no_grad():
            right = (trained(inputs).argmax(dim=-1) == targets)[:, 2:].float().mean().item()
        print(f"the exported model in plain PyTorch: {right:.0%} of next tokens right "
              f"(after the first two of each row)")
        return 0 if same and weights_same else 1


if __name__ == "__main__":
    sys.exit(main())
