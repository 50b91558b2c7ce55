"""The example's Llama-shaped model trained through layercast (2 shards, 2
workers, AdamW on the shards) against the same model trained in plain
PyTorch with an fp32 master, a bf16 compute copy and torch.optim.AdamW: the
losses and the final fp32 master bit for bit, with one shard restarted from
its checkpoint between two steps and another in the middle of one."""

import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import layercast
import layercast.torch
from shards import ShardSet, llama_tensors, read_safetensors

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import llama_train as example  # noqa: E402

STEPS = 50
WORKERS = 2
RESTART_AFTER = 25  # shard 1, between two steps
RESTART_MID_STEP = 37  # shard 0, after worker 0 pushed the step and before worker 1


def with_dropout(stages, p=0.1):
    """`stages` with dropout on the output of each but the last."""
    last = len(stages) - 1
    return [(name, fn if i == last else (lambda x, fn=fn: F.dropout(fn(x), p, training=True)))
            for i, (name, fn) in enumerate(stages)]


def reference(initial, workers=WORKERS, steps=STEPS, dropout=False):
    """Plain PyTorch: the fp32 master, a bf16 copy (norms fp32, as the
    policy says) per worker per step, the workers' gradients averaged in fp32
    in worker order, torch.optim.AdamW(foreach=False) with the shards' spec."""
    model = example.LlamaForCausalLM(device="meta")
    stages = with_dropout(model.stages()) if dropout else model.stages()
    masters = {name: tensor.clone() for name, tensor in initial.items()}
    decay = [t for n, t in masters.items() if "norm" not in n]
    no_decay = [t for n, t in masters.items() if "norm" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, foreach=False)
    losses = {w: [] for w in range(workers)}
    for step in range(steps):
        grads = []
        for worker in range(workers):
            compute = {n: (m.clone() if "norm" in n else m.to(torch.bfloat16)).requires_grad_()
                       for n, m in masters.items()}
            inputs, targets = example.batch(step, worker)
            with layercast.torch.bound(model, compute):
                x = inputs
                for _, fn in stages:
                    x = fn(x)
                loss = example.loss_fn(x, targets)
                loss.backward()
            losses[worker].append(loss.item())
            grads.append({n: t.grad for n, t in compute.items()})
        for name, master in masters.items():
            total = grads[0][name].float()
            for g in grads[1:]:
                total = total + g[name].float()
            master.grad = total / workers
        optimizer.step()
    return masters, losses


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    weights = example.initial_weights(seed=0)
    layercast.torch.save_safetensors(directory / "model.safetensors", weights)
    return directory, weights


def test_training_through_layercast_is_plain_pytorch_bit_for_bit(initial, tmp_path):
    directory, weights = initial
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    flags = ["--model", str(directory), "--policy", example.POLICY, "--optimizer",
             example.OPTIMIZER, "--data-parallel-workers", str(WORKERS),
             "--checkpoint-dir", str(checkpoints)]
    losses = {w: [] for w in range(WORKERS)}
    with ShardSet(tmp_path, 2, flags) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            model = example.LlamaForCausalLM(device="meta")
            trainers = [layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(), worker=w)
                        for w in range(WORKERS)]
            for step in range(STEPS):
                if step == RESTART_AFTER:
                    shards.restart(1)  # checkpoints on SIGTERM, resumes from it
                for worker, trainer in enumerate(trainers):
                    inputs, targets = example.batch(step, worker)
                    losses[worker].append(trainer.train_step(inputs, targets, example.loss_fn))
                    if step == RESTART_MID_STEP and worker == 0:
                        # Worker 0's pushes are staged on the shards, not
                        # applied: the checkpoint carries them.
                        shards.restart(0)
            assert trainers[0].version == STEPS
            assert trainers[0].bytes_pushed > 0 and trainers[0].bytes_fetched > 0
    want, want_losses = reference(weights)
    assert losses == want_losses, "the loss curve, step by step, bit for bit"
    parts = [read_safetensors(checkpoints / f"shard-{i}-of-2.safetensors") for i in range(2)]
    for name, master in want.items():
        got = torch.cat([part[name] for part in parts])
        assert got.numel() == master.numel(), name
        assert torch.equal(got.view(torch.int32), master.detach().flatten().view(torch.int32)), name
    assert losses[0][-1] < 0.5 * losses[0][0], "the model learns the task"


def test_dropout_in_the_backward_pass_draws_the_forward_passs_masks(initial, tmp_path):
    """Each stage runs again in the backward pass with the random state of
    its forward run: the gradients are those of the forward pass that gave
    the loss, so the loss curve is plain PyTorch's bit for bit, and the
    random state after a step is where plain PyTorch leaves it."""
    directory, weights = initial
    steps = 4
    flags = ["--model", str(directory), "--policy", example.POLICY, "--optimizer",
             example.OPTIMIZER, "--data-parallel-workers", "1"]
    with ShardSet(tmp_path, 2, flags) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            model = example.LlamaForCausalLM(device="meta")
            trainer = layercast.torch.LayerwiseTrainer(shard_set, model,
                                                       with_dropout(model.stages()))
            torch.manual_seed(7)
            losses = [trainer.train_step(*example.batch(step, 0), example.loss_fn)
                      for step in range(steps)]
            after = torch.get_rng_state()
    torch.manual_seed(7)
    _, want = reference(weights, workers=1, steps=steps, dropout=True)
    assert losses == want[0], "the loss curve with dropout, bit for bit"
    assert torch.equal(after, torch.get_rng_state()), "the random state a plain step leaves"


def test_float_inputs_take_the_policys_compute_dtype_and_outputs_its_output_dtype(tmp_path):
    """A float32 input into bf16 weights ("mat1 and mat2 must have the same
    dtype" in a plain call) is cast to the policy's compute dtype, and the
    result to its output dtype, float32."""
    tensors = llama_tensors(layers=1, hidden=64, ffn=96)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    layercast.torch.save_safetensors(model_dir / "model.safetensors", tensors)
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([example.Block(64, 4, 96, device="meta")])
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    (tmp_path / "shards").mkdir()
    policy = "params=float32,compute=bfloat16,output=float32;*norm*=float32"
    with ShardSet(tmp_path / "shards", 2, ["--model", str(model_dir), "--policy",
                                           policy]) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            trainer = layercast.torch.LayerwiseTrainer(
                shard_set, root, [("model.layers.0", root.model.layers[0])])
            got = trainer.forward(x)
    compute = {n: (t if "norm" in n else t.to(torch.bfloat16))
               for n, t in tensors.items() if n.startswith("model.layers.0.")}
    with torch.no_grad(), layercast.torch.bound(root, compute):
        want = root.model.layers[0](x.to(torch.bfloat16)).float()
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


def test_the_example_trains_with_two_worker_processes(initial, tmp_path):
    directory, _ = initial
    flags = ["--model", str(directory), "--policy", example.POLICY, "--optimizer",
             example.OPTIMIZER, "--data-parallel-workers", "2"]
    with ShardSet(tmp_path, 2, flags) as shards:
        run = subprocess.run(
            [sys.executable, str(pathlib.Path(example.__file__)), "train", "--shards",
             ",".join(shards.addresses), "--workers", "2", "--steps", "3"],
            capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "step    2  loss" in run.stdout, run.stdout
    assert "3 steps of 2 workers" in run.stdout
