"""Recomputes layercast's shard-side training with plain torch.optim.

Usage: training_torch_test.py DESCRIPTION.json, written by
tests/integration/training_torch_test.cc (initial fp32 values beside it in
DESCRIPTION.json.f32). For every recipe, each tensor becomes its own param
group of torch.optim.AdamW / torch.optim.SGD (foreach=False, CPU, fp32) with
that tensor's hyper-parameters; every step sets each group's lr from the
schedule in the spec (linear warm-up, then cosine decay to min_lr), sets
p.grad to the mean of the workers' synthetic gradients, each rounded to the
tensor's compute dtype and widened back, summed in worker order and divided
by the worker count; with clip= in the spec, scales them as
torch.nn.utils.clip_grad_norm_ does, given the global norm accumulated in
fp64; and steps. The result must have the same bits as the
fp32 master the shards wrote to their checkpoints (shard-<i>-of-<N>
.safetensors, each tensor's owned slice, concatenated in shard order).
Exits 1 naming the first mismatches.
"""

import json
import math
import struct
import sys

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def synthetic_gradient(worker, step, layer, tensor, elements):
    """tools/synthetic_gradient.h: float32(k - 500) * float32(1e-4)."""
    i = np.arange(elements, dtype=np.uint64)
    k = (i * 7 + tensor * 13 + layer * 31 + step * 17 + worker * 101) % 1000
    return (k.astype(np.int64) - 500).astype(np.float32) * np.float32(1e-4)


def schedule(spec):
    """The spec's lr schedule as a function of the 1-based step and a peak lr."""
    fields = dict(kv.split("=") for kv in spec.split(";")[0].split(":", 1)[1].split(","))
    default_lr = float(fields["lr"])
    warmup = int(fields.get("warmup_steps", 0))
    decay = int(fields.get("decay_steps", 0))
    min_lr = float(fields.get("min_lr", 0))

    def lr_at(peak, step):
        if step == 0:
            return 0.0
        if step <= warmup:
            return peak * step / warmup
        if decay == 0:
            return peak
        floor = min_lr / default_lr if default_lr > 0 else 0.0
        decayed = step - warmup
        if decayed >= decay:
            return peak * floor
        cosine = (1 + math.cos(math.pi * decayed / decay)) / 2
        return peak * (floor + (1 - floor) * cosine)

    return lr_at


def clip_of(spec):
    """The spec's clip= (max_norm), or None."""
    fields = dict(kv.split("=") for kv in spec.split(";")[0].split(":", 1)[1].split(","))
    return float(fields["clip"]) if "clip" in fields else None


def read_safetensors(path):
    data = open(path, "rb").read()
    (header_len,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", (path, name, info["dtype"])
        begin, end = info["data_offsets"]
        tensors[name] = (torch.frombuffer(bytearray(data[base + begin : base + end]), dtype=torch.float32)
                         if end > begin else torch.empty(0, dtype=torch.float32))
    return tensors, header.get("__metadata__", {})


def bits(t):
    return t.contiguous().view(torch.int32)


def run(description, recipe, initial):
    tensors = description["tensors"]
    workers = description["workers"]
    params = [torch.nn.Parameter(initial[i].clone()) for i in range(len(tensors))]
    groups = []
    for p, hyper in zip(params, recipe["hyper"]):
        group = {"params": [p], "lr": hyper["lr"], "weight_decay": hyper["weight_decay"]}
        if recipe["kind"] == "adamw":
            group.update(betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"])
        else:
            group.update(momentum=hyper["momentum"], nesterov=hyper["nesterov"], dampening=0)
        groups.append(group)
    if recipe["kind"] == "adamw":
        optimizer = torch.optim.AdamW(groups, foreach=False)
    else:
        optimizer = torch.optim.SGD(groups, lr=recipe["hyper"][0]["lr"], foreach=False)
    lr_at = schedule(recipe["spec"])
    max_norm = clip_of(recipe["spec"])
    for step in range(description["steps"]):
        for group, hyper in zip(optimizer.param_groups, recipe["hyper"]):
            group["lr"] = lr_at(hyper["lr"], step + 1)
        for p, tensor in zip(params, tensors):
            mean = None
            for w in range(workers):
                g = torch.from_numpy(
                    synthetic_gradient(w, step, tensor["layer"], tensor["index"], tensor["elements"]))
                g = g.to(DTYPES[tensor["compute_dtype"]]).to(torch.float32)
                mean = g.clone() if mean is None else mean.add_(g)
            p.grad = mean.div_(workers)
        if max_norm is not None:
            # torch 1.13.1's clip_grad_norm_ from its total_norm on, with the
            # norm accumulated in fp64 as the shards do (torch's own fp32
            # reduction order cannot be reproduced across shards).
            total = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
            total_norm = torch.tensor(total, dtype=torch.float32)
            clip_coef = max_norm / (total_norm + 1e-6)
            clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
            assert clip_coef_clamped < 1, "the recipe's gradients must be clipped"
            for p in params:
                p.grad.detach().mul_(clip_coef_clamped)
        optimizer.step()
    return [p.detach() for p in params]


def main(path):
    description = json.load(open(path))
    tensors = description["tensors"]
    raw = torch.from_numpy(np.fromfile(path + ".f32", dtype=np.float32))
    initial, offset = [], 0
    for tensor in tensors:
        initial.append(raw[offset : offset + tensor["elements"]])
        offset += tensor["elements"]
    assert offset == raw.numel(), (offset, raw.numel())

    failed = 0
    for recipe in description["recipes"]:
        want = run(description, recipe, initial)
        n = description["num_shards"]
        parts = [read_safetensors(f"{recipe['checkpoint_dir']}/shard-{i}-of-{n}.safetensors") for i in range(n)]
        mismatched = 0
        for t, tensor in enumerate(tensors):
            got = torch.cat([part[0][tensor["name"]] for part in parts])
            if got.numel() != want[t].numel():
                print(f"{recipe['name']}: {tensor['name']}: {got.numel()} elements, want {want[t].numel()}")
                mismatched += 1
                continue
            if torch.equal(bits(got), bits(want[t])):
                continue
            bad = (bits(got) != bits(want[t])).nonzero().flatten()
            mismatched += 1
            i = bad[0].item()
            print(f"{recipe['name']}: {tensor['name']}: {bad.numel()} of {got.numel()} elements differ; "
                  f"first at {i}: shards {got[i].item()!r}, torch {want[t][i].item()!r}")
        moved = sum(int((bits(w) != bits(i)).sum()) for w, i in zip(want, initial))
        versions = {part[1].get("version") for part in parts}
        print(f"{recipe['name']}: {len(tensors)} tensors, {moved} of {offset} elements changed by "
              f"{description['steps']} steps; checkpoint versions {sorted(versions)}; "
              f"{'bit-identical to torch' if mismatched == 0 else f'{mismatched} tensors differ'}")
        if moved == 0:
            print(f"{recipe['name']}: training changed nothing: the check would prove nothing")
            mismatched += 1
        if versions != {str(description["steps"])}:
            print(f"{recipe['name']}: checkpoints hold versions {versions}, want {description['steps']}")
            mismatched += 1
        failed += mismatched
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
