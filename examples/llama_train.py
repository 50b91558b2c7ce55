#!/usr/bin/env python3
"""Trains a small Llama-shaped model through layercast, on the CPU.

The fp32 master and the AdamW state live on the shards; the workers build the
model on the `meta` device and hold, at any moment, only the bf16 weights of
the layer they run (layercast.torch.LayerwiseTrainer). Each step, every
worker gathers each layer forward, then backward again, pushes each layer's
gradient as soon as its backward is done, and the shards average the workers'
gradients in fp32 and step AdamW on the master.

The task is synthetic and deterministic: sequences of tokens that follow
x[t+1] = (7 * x[t] + 3) mod vocab from a random start; the model learns to
predict the next token, and the loss falls.

    # 1. the initial weights, as a safetensors file the shards serve
    PYTHONPATH=build/python /usr/bin/python3 examples/llama_train.py init /tmp/llama
    # 2. two training shards (in two shells, or with &)
    build/bin/layercast-shard --model /tmp/llama --shard-index 0 --num-shards 2 \\
        --listen 127.0.0.1:7070 --optimizer "adamw:lr=3e-3,weight_decay=0.1;*norm*:weight_decay=0" \\
        --data-parallel-workers 2 --policy "p=f32,c=bf16;*norm*=f32"
    build/bin/layercast-shard ... --shard-index 1 ... --listen 127.0.0.1:7071 ...
    # 3. two worker processes
    PYTHONPATH=build/python /usr/bin/python3 examples/llama_train.py train \\
        --shards 127.0.0.1:7070,127.0.0.1:7071 --workers 2 --steps 300

examples/llama_train.sh does all three with the build tree's binaries.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import pathlib
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = dict(vocab=64, hidden=64, heads=4, ffn=128, blocks=3, seq=32, batch=8)
OPTIMIZER = "adamw:lr=3e-3,weight_decay=0.1;*norm*:weight_decay=0"
POLICY = "p=f32,c=bf16;*norm*=f32"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, device=None):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False, device=device)
        self.k_proj = nn.Linear(hidden, hidden, bias=False, device=device)
        self.v_proj = nn.Linear(hidden, hidden, bias=False, device=device)
        self.o_proj = nn.Linear(hidden, hidden, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = (proj(x).view(b, t, self.heads, d).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(d)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        weights = scores.masked_fill(causal, float("-inf")).softmax(-1).to(x.dtype)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, device=device)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, device=device)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, device=device)
        self.self_attn = Attention(hidden, heads, device=device)
        self.post_attention_layernorm = RMSNorm(hidden, device=device)
        self.mlp = MLP(hidden, ffn, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: dict, device=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"], device=device)
        self.layers = nn.ModuleList(Block(c["hidden"], c["heads"], c["ffn"], device=device)
                                    for _ in range(c["blocks"]))
        self.norm = RMSNorm(c["hidden"], device=device)


class LlamaForCausalLM(nn.Module):
    """Named as Hugging Face names Llama's tensors, so that its parameter
    names are the shards' tensor names."""

    def __init__(self, c: dict = CONFIG, device=None):
        super().__init__()
        self.model = Decoder(c, device=device)
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False, device=device)

    def stages(self):
        """(layer name, fn) per layercast layer, in forward order."""
        return ([("model.embed_tokens", self.model.embed_tokens)] +
                [(f"model.layers.{i}", block) for i, block in enumerate(self.model.layers)] +
                [("final", lambda h: self.lm_head(self.model.norm(h)))])


def initial_weights(seed: int = 0, c: dict = CONFIG) -> Dict[str, torch.Tensor]:
    """The fp32 master at step 0: Llama's initialisation, deterministic."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def batch(step: int, worker: int, c: dict = CONFIG):
    """Worker `worker`'s batch of step `step`: (input ids, target ids)."""
    g = torch.Generator().manual_seed(1_000_003 * step + worker)
    x = torch.empty(c["batch"], c["seq"] + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, c["vocab"], (c["batch"],), generator=g)
    for t in range(c["seq"]):
        x[:, t + 1] = (7 * x[:, t] + 3) % c["vocab"]
    return x[:, :-1], x[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def worker_main(shards: List[str], worker: int, steps: int, first_step: int,
                results: Optional["multiprocessing.Queue"] = None) -> List[float]:
    import layercast
    import layercast.torch

    torch.manual_seed(0)
    model = LlamaForCausalLM(device="meta")
    losses = []
    with layercast.connect(shards) as shard_set:
        trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(), worker=worker)
        if trainer.version != first_step:
            raise SystemExit(f"the shards are at step {trainer.version}, not {first_step}")
        for step in range(first_step, first_step + steps):
            inputs, targets = batch(step, worker)
            start = time.perf_counter()
            loss = trainer.train_step(inputs, targets, loss_fn)
            losses.append(loss)
            if results is not None:
                results.put((worker, step, loss, time.perf_counter() - start, trainer.bytes_fetched,
                             trainer.fetch_seconds, trainer.bytes_pushed, trainer.push_seconds))
    return losses


def init(args) -> int:
    from layercast.torch import save_safetensors
    directory = pathlib.Path(args.directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_safetensors(directory / "model.safetensors", initial_weights(args.seed))
    print(f"wrote the initial fp32 weights to {directory / 'model.safetensors'}")
    return 0


def train(args) -> int:
    shards = [s.strip() for s in args.shards.split(",") if s.strip()]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=worker_main,
                                 args=(shards, w, args.steps, args.first_step, results))
                 for w in range(args.workers)]
    for p in processes:
        p.start()
    by_step: Dict[int, dict] = {}
    losses = {w: [] for w in range(args.workers)}
    printed = args.first_step
    start = time.perf_counter()
    while printed < args.first_step + args.steps:
        if not any(p.is_alive() for p in processes) and results.empty():
            print("a worker exited early: see its error above", file=sys.stderr)
            return 1
        try:
            worker, step, loss, seconds, fetched, fetch_s, pushed, push_s = results.get(timeout=1)
        except Exception:
            continue
        losses[worker].append(loss)
        entry = by_step.setdefault(step, {})
        entry[worker] = (loss, seconds, fetched, fetch_s, pushed, push_s)
        while len(by_step.get(printed, {})) == args.workers:
            entry = by_step.pop(printed)
            mean = sum(v[0] for v in entry.values()) / args.workers
            w0 = entry[0]
            print(f"step {printed:4d}  loss {mean:.4f}  {w0[1] * 1000:6.1f} ms  "
                  f"worker 0 so far: fetched {w0[2] / 2**20:7.1f} MiB in {w0[3]:5.2f} s, "
                  f"pushed {w0[4] / 2**20:7.1f} MiB in {w0[5]:5.2f} s", flush=True)
            printed += 1
    for p in processes:
        p.join(timeout=60)
    print(f"{args.steps} steps of {args.workers} workers in {time.perf_counter() - start:.1f} s")
    if args.losses_out:
        pathlib.Path(args.losses_out).write_text(json.dumps(losses))
    return 0 if all(p.exitcode == 0 for p in processes) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("init", help="write the initial weights for the shards to serve")
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0)
    p = commands.add_parser("train", help="train through running shards")
    p.add_argument("--shards", required=True, help="host:port,... in shard order")
    p.add_argument("--workers", type=int, default=2, help="the shards' --data-parallel-workers")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--first-step", type=int, default=0)
    p.add_argument("--losses-out", help="write every worker's loss per step here (JSON)")
    args = parser.parse_args()
    return init(args) if args.command == "init" else train(args)


if __name__ == "__main__":
    sys.exit(main())
