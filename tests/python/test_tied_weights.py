"""Tied weights (GPT-2's lm_head.weight = transformer.wte.weight) through
layercast: the shards hold the tensor once, the last stage gathers the
first layer for it, and its gradient is the sum of both uses, so the
losses and the exported master are plain PyTorch's AdamW run bit for bit,
whether the model was saved with state_dict() (both names) or
named_parameters() (one). A parameter no layer binds is refused by name."""

import pathlib
import sys

import pytest
import torch

import layercast
import layercast.torch
from shards import ShardSet, bits

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import gpt2_train as example  # noqa: E402

STEPS = 4


def serve(tmp_path, tensors, flags):
    (tmp_path / "model").mkdir()
    layercast.torch.save_safetensors(tmp_path / "model" / "model.safetensors", tensors)
    (tmp_path / "shards").mkdir()
    return ShardSet(tmp_path / "shards", 2, ["--model", str(tmp_path / "model")] + flags)


@pytest.mark.parametrize("saved_with", ["state_dict", "named_parameters"])
def test_tied_embeddings_train_as_plain_pytorch_bit_for_bit(tmp_path, saved_with):
    state = example.initial_state()
    if saved_with == "named_parameters":
        model = example.GPT()
        model.load_state_dict(state)
        tensors = dict(model.named_parameters())
        assert "lm_head.weight" not in tensors
    else:
        tensors = state
        assert tensors["lm_head.weight"].data_ptr() == tensors["transformer.wte.weight"].data_ptr()
    with serve(tmp_path, tensors, example.SHARD_FLAGS) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            served = [t["name"] for layer in shard_set.manifest["layers"] for t in layer["tensors"]]
            assert "lm_head.weight" not in served, "the tied tensor is held once"
            losses, _ = example.train(shard_set, STEPS, log=lambda _: None)
            exported = layercast.torch.load_safetensors(
                shard_set.export(str(tmp_path / "trained.safetensors"))["files"][0])
    want_losses, want = example.reference(state, STEPS)
    assert losses == want_losses, "the loss curve, with dropout, bit for bit"
    assert exported.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(bits(exported[name]), bits(tensor)), name
    # Reloaded into plain PyTorch: the tie fills the one name not exported.
    trained = example.GPT()
    loaded = trained.load_state_dict({**exported, **example.fresh_buffers()}, strict=False)
    assert loaded.missing_keys == ["lm_head.weight"] and not loaded.unexpected_keys
    assert torch.equal(bits(trained.lm_head.weight.detach()), bits(want["transformer.wte.weight"]))


def test_a_parameter_no_layer_binds_is_refused_by_name(tmp_path):
    """The model's lm_head is not tied here, and the shards (the tied
    model's tensors) have no lm_head.weight: the last stage names it, where
    it would have returned a meta tensor with no values."""
    flags = example.SHARD_FLAGS[:2] + example.SHARD_FLAGS[4:]  # read-only: no --optimizer
    with serve(tmp_path, example.initial_state(), flags) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            model = example.GPT(device="meta")
            model.lm_head.weight = torch.nn.Parameter(torch.empty(example.VOCAB, example.WIDTH,
                                                                  device="meta"))
            trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(),
                                                       buffers=example.fresh_buffers())
            with pytest.raises(layercast.torch.UnboundParameterError,
                               match=r"stage 'final' uses the model's parameter lm_head\.weight, "
                                     r"which the shards do not serve"):
                trainer.forward(example.batch(0)[0])


def test_a_tied_tensor_the_shards_hold_twice_is_refused(tmp_path):
    """Two copies would be trained apart: refused before anything runs."""
    state = example.initial_state()
    state["lm_head.weight"] = state["lm_head.weight"].clone()  # no longer the same tensor
    with serve(tmp_path, state, example.SHARD_FLAGS[:2] + example.SHARD_FLAGS[4:]) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            model = example.GPT(device="meta")
            with pytest.raises(ValueError, match=r"the shards hold \['transformer\.wte\.weight', "
                                                 r"'lm_head\.weight'\] as separate tensors"):
                layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(),
                                                 buffers=example.fresh_buffers())


def test_a_parameter_the_shards_hold_in_another_layer_is_named_with_its_layer(tmp_path):
    """docs/models.md's old GPT-2 row (--first-layer-prefix transformer.wte.)
    leaves transformer.wpe in `final`: the embedding stage says so, where
    torch said "Expected all tensors to be on the same device"."""
    flags = ["--policy", example.POLICY, "--layer-regex", r"^transformer\.h\.(\d+)\.",
             "--first-layer-prefix", "transformer.wte."]
    with serve(tmp_path, example.initial_state(), flags) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            model = example.GPT(device="meta")
            stages = [("transformer.wte", model.embed)] + model.stages()[1:]
            trainer = layercast.torch.LayerwiseTrainer(shard_set, model, stages,
                                                       buffers=example.fresh_buffers())
            with pytest.raises(layercast.torch.UnboundParameterError,
                               match=r"stage 'transformer\.wte' uses transformer\.wpe\.weight, "
                                     r"which the shards serve in layer 'final'"):
                trainer.forward(example.batch(0)[0])


def bf16_reference(state, steps):
    """Plain PyTorch as a bf16 policy says: an fp32 master, a bfloat16
    copy of it each step (the tied tensor's one copy under both names), the
    output cast to float32, torch.optim.AdamW(foreach=False) on the master."""
    model = example.GPT()
    model.load_state_dict(state)
    model.train()
    masters = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(list(masters.values()), lr=example.LR,
                                  weight_decay=example.WEIGHT_DECAY, foreach=False)
    torch.manual_seed(0)
    losses = []
    for step in range(steps):
        compute = {n: m.to(torch.bfloat16).requires_grad_() for n, m in masters.items()}
        with layercast.torch.bound(model, {**compute,
                                           "lm_head.weight": compute["transformer.wte.weight"]}):
            inputs, targets = example.batch(step)
            loss = example.loss_fn(model(inputs).float(), targets)
            loss.backward()
        losses.append(loss.item())
        for name, master in masters.items():
            master.grad = compute[name].grad.float()
        optimizer.step()
    return losses, masters


def test_tied_embeddings_in_bf16_sum_their_two_bf16_gradients_as_autograd_does(tmp_path):
    state = example.initial_state()
    flags = ["--policy", "p=f32,c=bf16,o=f32"] + example.SHARD_FLAGS[2:]
    with serve(tmp_path, state, flags) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            losses, _ = example.train(shard_set, STEPS, log=lambda _: None)
            exported = layercast.torch.load_safetensors(
                shard_set.export(str(tmp_path / "trained.safetensors"))["files"][0])
    want_losses, want = bf16_reference(state, STEPS)
    assert losses == want_losses, "the loss curve, bit for bit"
    for name, tensor in want.items():
        assert torch.equal(bits(exported[name]), bits(tensor)), name


def test_the_loop_pytorch_users_know_accumulates_the_tied_gradient(tmp_path):
    """trainer(x), loss.backward() per micro batch, then step(): the tied
    tensor's gradient adds up over both uses and both micro batches, as
    plain PyTorch's .grad does."""
    state = example.initial_state()
    micro, steps = 2, 2
    with serve(tmp_path, state, example.SHARD_FLAGS) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            model = example.GPT(device="meta")
            trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(),
                                                       buffers=example.fresh_buffers())
            torch.manual_seed(0)
            losses = []
            for step in range(steps):
                for m in range(micro):
                    loss = example.loss_fn(trainer(example.batch(step * micro + m)[0]),
                                           example.batch(step * micro + m)[1]) / micro
                    loss.backward()
                    losses.append(loss.item())
                trainer.step()
            exported = layercast.torch.load_safetensors(
                shard_set.export(str(tmp_path / "trained.safetensors"))["files"][0])
    reference = example.GPT()
    reference.load_state_dict(state)
    reference.train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=example.LR,
                                  weight_decay=example.WEIGHT_DECAY, foreach=False)
    torch.manual_seed(0)
    want_losses = []
    for step in range(steps):
        optimizer.zero_grad()
        for m in range(micro):
            inputs, targets = example.batch(step * micro + m)
            loss = example.loss_fn(reference(inputs), targets) / micro
            loss.backward()
            want_losses.append(loss.item())
        optimizer.step()
    assert losses == want_losses
    for name, tensor in reference.named_parameters():
        assert torch.equal(bits(exported[name]), bits(tensor.detach())), name
