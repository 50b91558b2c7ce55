"""Training state in and out of PyTorch: K steps of a small GPT-2 in plain
PyTorch (AdamW, or SGD with Nesterov momentum; weight decay in two param
groups, global-norm clipping, dropout), moved to two shards
(save_optimizer_state, split with an index; --optimizer-state), K steps
there (one shard restarted between two), their checkpoint moved back
(export_checkpoint, load_optimizer_state), K more in PyTorch: every loss,
the final parameters and the optimizer's final state are those of 3K steps
entirely in PyTorch, bit for bit. A state file that does not fit the shard
refuses its start with one line, and one that does not fit the torch
optimizer is refused by load_optimizer_state."""

import math
import pathlib
import re
import sys

import pytest
import torch

import layercast
import layercast.torch
from shards import ShardSet, bits

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import gpt2_train as example  # noqa: E402

K = 2
SPLIT = 100_000  # bytes per file: the model's state is split in three
CLIP = 0.5
# Biases and LayerNorm weights without weight decay, as GPT recipes group them.
NO_DECAY = ";*.bias:weight_decay=0;*ln_*:weight_decay=0"
OPTIMIZER = f"adamw:lr={example.LR},weight_decay={example.WEIGHT_DECAY},clip={CLIP}{NO_DECAY}"
SGD = (f"sgd:lr={example.LR},momentum=0.9,nesterov=1,weight_decay={example.WEIGHT_DECAY},"
       f"clip={CLIP}{NO_DECAY}")


def flags(optimizer: str = OPTIMIZER):
    return ["--policy", example.POLICY, "--optimizer", optimizer,
            "--layer-regex", r"^transformer\.h\.(\d+)\.", "--first-layer-prefix", "transformer.w"]


def adamw(model: torch.nn.Module, lr: float = example.LR) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, weight_decay=example.WEIGHT_DECAY, foreach=False)


def sgd(model: torch.nn.Module, lr: float = example.LR) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.SGD([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                           lr=lr, momentum=0.9, nesterov=True, weight_decay=example.WEIGHT_DECAY,
                           foreach=False)


# kind: (--optimizer, torch's optimizer, its state buffers, what
# save_optimizer_state is told: torch's SGD does not count its steps).
KINDS = {"adamw": (OPTIMIZER, adamw, ("exp_avg", "exp_avg_sq"), {}),
         "sgd": (SGD, sgd, ("momentum_buffer",), {"steps": K})}


def clip_(model: torch.nn.Module) -> float:
    """torch 1.13's clip_grad_norm_ from its total_norm on, the norm summed
    in fp64 as the shards sum it (torch's fp32 reduction order is its own)."""
    params = list(model.parameters())
    total = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    coef = torch.clamp(CLIP / (torch.tensor(total, dtype=torch.float32) + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef)
    return float(coef)


def torch_steps(model, optimizer, steps, losses, scales):
    model.train()
    for step in steps:
        inputs, targets = example.batch(step)
        torch.manual_seed(100 + step)  # dropout's masks, the same in every run
        optimizer.zero_grad()
        loss = example.loss_fn(model(inputs), targets)
        loss.backward()
        scales.append(clip_(model))
        optimizer.step()
        losses.append(loss.item())


def fresh_model() -> torch.nn.Module:
    model = example.GPT()
    model.load_state_dict(example.initial_state())
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_pytorch_to_layercast_and_back_bit_for_bit(tmp_path, kind):
    spec, make, buffers, told = KINDS[kind]
    want_losses, scales = [], []
    reference = fresh_model()
    reference_optimizer = make(reference)
    torch_steps(reference, reference_optimizer, range(3 * K), want_losses, scales)
    assert min(scales) < 1, "the gradients must be clipped for clipping to be tested"

    # 1. K steps in PyTorch, then its model and AdamW's state to files.
    losses = []
    model = fresh_model()
    optimizer = make(model)
    torch_steps(model, optimizer, range(K), losses, [])
    (tmp_path / "model").mkdir()
    layercast.torch.save_safetensors(tmp_path / "model" / "model.safetensors", model.state_dict())
    # Split, as a large model's state is: the shards take the index.
    files = layercast.torch.save_optimizer_state(tmp_path / "optimizer.safetensors", optimizer,
                                                 model, max_file_bytes=SPLIT, **told)
    state = tmp_path / "optimizer.safetensors.index.json"
    assert files[-1] == str(state) and len(files) > 2

    # 2. K steps through two shards started from them; SIGTERM checkpoints.
    (tmp_path / "shards").mkdir()
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    with ShardSet(tmp_path / "shards", 2,
                  ["--model", str(tmp_path / "model"), "--optimizer-state", str(state),
                   "--checkpoint-dir", str(checkpoints)] + flags(spec)) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            assert shard_set.version() == K, "the layers go on at the state's step"
            meta = example.GPT(device="meta")
            meta.train()
            trainer = layercast.torch.LayerwiseTrainer(shard_set, meta, meta.stages(),
                                                       buffers=example.fresh_buffers())
            for step in range(K, 2 * K):
                if step == K + 1:
                    # Restarted, a shard goes on from its checkpoint, not
                    # from the state it first started from.
                    shards.restart(1)
                torch.manual_seed(100 + step)
                losses.append(trainer.train_step(*example.batch(step), example.loss_fn))
    exported = layercast.torch.export_checkpoint(checkpoints, tmp_path / "exported",
                                                 example.GPT(device="meta"), max_file_bytes=SPLIT)
    assert exported["step"] == exported["version"] == 2 * K
    back = tmp_path / "exported"
    assert {pathlib.Path(f).name for f in exported["files"]} >= {
        "model.safetensors.index.json", "optimizer.safetensors.index.json"}

    # 3. Back into PyTorch (the optimizer built with another lr: the file's
    # is taken), K more steps.
    model = example.GPT()
    weights = layercast.torch.load_safetensors(back / "model.safetensors.index.json")
    loaded = model.load_state_dict({**weights, **example.fresh_buffers()}, strict=False)
    assert loaded.missing_keys == ["lm_head.weight"] and not loaded.unexpected_keys
    optimizer = make(model, lr=1.0)
    layercast.torch.load_optimizer_state(back / "optimizer.safetensors.index.json", optimizer,
                                         model)
    assert [g["lr"] for g in optimizer.param_groups] == [example.LR, example.LR]
    torch_steps(model, optimizer, range(2 * K, 3 * K), losses, [])

    assert losses == want_losses, "every loss, bit for bit"
    got = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.equal(bits(got[name].detach()), bits(p.detach())), name
        mine, theirs = optimizer.state[got[name]], reference_optimizer.state[p]
        if kind == "adamw":
            assert torch.equal(mine["step"], theirs["step"]), name
        for buffer in buffers:
            assert torch.equal(bits(mine[buffer]), bits(theirs[buffer])), (name, buffer)


def state_file(tmp_path) -> pathlib.Path:
    """The model and one step of AdamW's state, written as in step 1 above."""
    model = fresh_model()
    optimizer = adamw(model)
    torch_steps(model, optimizer, range(1), [], [])
    (tmp_path / "model").mkdir()
    layercast.torch.save_safetensors(tmp_path / "model" / "model.safetensors", model.state_dict())
    layercast.torch.save_optimizer_state(tmp_path / "optimizer.safetensors", optimizer, model)
    return tmp_path / "optimizer.safetensors"


@pytest.mark.parametrize("change, line", [
    ("kind", r"holds adamw state, but --optimizer is sgd"),
    ("weight_decay", r"parameter transformer\.w\w+\.weight has weight_decay 0\.01 there, 0\.1 in "
                     r"--optimizer"),
    ("missing", r"no state\.transformer\.ln_f\.bias\.exp_avg_sq: every parameter"),
])
def test_a_state_that_does_not_fit_refuses_the_start(tmp_path, change, line):
    state = state_file(tmp_path)
    optimizer = OPTIMIZER
    if change == "kind":
        optimizer = SGD
    elif change == "weight_decay":
        optimizer = OPTIMIZER.replace(f"weight_decay={example.WEIGHT_DECAY}", "weight_decay=0.1")
    else:
        tensors = layercast.torch.load_safetensors(state)
        del tensors["state.transformer.ln_f.bias.exp_avg_sq"]
        metadata = layercast.training_state._metadata(state)
        layercast.torch.save_safetensors(state, tensors, metadata)
    (tmp_path / "shards").mkdir()
    refused = f"--optimizer-state {re.escape(str(state))}: .*{line}"
    with pytest.raises(RuntimeError, match=refused):
        ShardSet(tmp_path / "shards", 1,
                 ["--model", str(tmp_path / "model"), "--optimizer-state", str(state)] + flags(optimizer))


def test_a_shard_without_a_checkpoint_dir_starts_from_the_state(tmp_path):
    state = state_file(tmp_path)
    (tmp_path / "shards").mkdir()
    with ShardSet(tmp_path / "shards", 1, ["--model", str(tmp_path / "model"),
                                           "--optimizer-state", str(state)] + flags()) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            assert shard_set.version() == 1


def test_torch_refuses_a_state_that_does_not_fit(tmp_path):
    state = state_file(tmp_path)
    model = fresh_model()
    with pytest.raises(ValueError, match="holds adamw state; the optimizer is sgd"):
        layercast.torch.load_optimizer_state(state, sgd(model), model)
    tensors = layercast.torch.load_safetensors(state)
    tensors["state.transformer.ln_f.bias.exp_avg"] = torch.zeros(3)
    metadata = layercast.training_state._metadata(state)
    layercast.torch.save_safetensors(state, tensors, metadata)
    with pytest.raises(ValueError, match=r"transformer\.ln_f\.bias's exp_avg is \(3,\), the "
                                         r"parameter \(32,\)"):
        layercast.torch.load_optimizer_state(state, adamw(model), model)


def test_plain_sgd_takes_its_step_count_from_steps(tmp_path):
    # torch's SGD without momentum keeps no state: the file's step is
    # steps=, so the shards' learning-rate schedule goes on where it was.
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = tmp_path / "state.safetensors"
    layercast.torch.save_optimizer_state(path, optimizer, model, steps=7)
    tensors = layercast.torch.load_safetensors(path)
    assert {name: float(t) for name, t in tensors.items()} == \
        {"state.weight.step": 7.0, "state.bias.step": 7.0}
