"""The layercast Python package against real shard processes on 127.0.0.1:
layers as zero-copy DLPack views, bit for bit torch's casts; the budget; the
errors of bad use; gradients pushed back and applied by the shards."""

import gc
import pathlib

import pytest
import torch

import layercast
import layercast.torch
from layercast.torch import dequantize, save_safetensors
from shards import ShardSet, bits, llama_tensors

POLICY = "p=f32,c=bf16;*norm*=f32"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("model")
    tensors = llama_tensors()
    save_safetensors(directory / "model.safetensors", tensors)
    return directory, tensors


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    directory, tensors = model
    with ShardSet(tmp_path_factory.mktemp("shards"), 2,
                  ["--model", str(directory), "--policy", POLICY]) as shards:
        yield shards, tensors


def expected(tensors, name):
    source = tensors[name]
    return source if "norm" in name else source.to(torch.bfloat16)


def test_every_tensor_is_torchs_cast_bit_for_bit(served):
    shards, tensors = served
    with layercast.connect(shards.addresses) as shard_set:
        manifest = shard_set.manifest
        assert manifest["num_shards"] == 2
        order = range(len(manifest["layers"]))
        seen = set()
        for layer in shard_set.stream(order, budget_bytes=1 << 20):
            for name, view in layer.tensors.items():
                got = torch.from_dlpack(view)
                want = expected(tensors, name)
                assert got.dtype == want.dtype, name
                assert got.shape == want.shape, name
                assert torch.equal(bits(got), bits(want)), name
                seen.add(name)
        assert seen == set(tensors), "every tensor of the model came through"


def test_a_state_dict_with_bf16_weights_and_integer_buffers_is_saved_and_served(tmp_path):
    tensors = llama_tensors(layers=1)
    narrow = "model.layers.0.mlp.up_proj.weight"
    tensors[narrow] = tensors[narrow].to(torch.bfloat16)
    tensors["model.layers.0.norm.num_batches_tracked"] = torch.tensor(7)  # int64
    with pytest.raises(TypeError, match="float64, which the shards cannot serve"):
        save_safetensors(tmp_path / "wide.safetensors", {"x": torch.zeros(2, dtype=torch.float64)})
    assert not (tmp_path / "wide.safetensors").exists()
    model = tmp_path / "model"
    model.mkdir()
    save_safetensors(model / "model.safetensors", tensors)
    (tmp_path / "shards").mkdir()
    with ShardSet(tmp_path / "shards", 2, ["--model", str(model), "--policy", "c=f32"]) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            manifest = shard_set.manifest
            seen = {}
            for layer in shard_set.stream(range(len(manifest["layers"])), budget_bytes=1 << 20):
                for name, view in layer.tensors.items():
                    seen[name] = torch.from_dlpack(view).clone()
    assert "model.layers.0.norm.num_batches_tracked" not in seen, "integer buffers are skipped"
    assert seen.keys() == {n for n in tensors if tensors[n].is_floating_point()}
    for name, got in seen.items():
        assert torch.equal(bits(got), bits(tensors[name].float())), name  # bf16 widened exactly


def test_a_trainer_is_refused_at_once_what_the_shards_would_refuse_later(served, model,
                                                                         tmp_path):
    """Training against read-only shards, a worker index the set does not
    expect and a layer listed twice are refused before any gather."""
    stages = [("model.layers.0", lambda x: x)]
    shards, _ = served
    with layercast.connect(shards.addresses) as shard_set:
        assert shard_set.manifest["optimizer"] == ""
        assert shard_set.manifest["data_parallel_workers"] == 0
        reader = layercast.torch.LayerwiseTrainer(shard_set, torch.nn.Module(), stages)
        with pytest.raises(ValueError, match="the shards run no optimizer"):
            reader.train_step(torch.zeros(1), torch.zeros(1), lambda out, target: out.sum())
        assert reader.bytes_fetched == 0, "refused before gathering anything"
    directory, _ = model
    with ShardSet(tmp_path, 2, ["--model", str(directory), "--policy", POLICY, "--optimizer",
                                "sgd:lr=0.1", "--data-parallel-workers", "2"]) as training:
        with layercast.connect(training.addresses) as shard_set:
            assert shard_set.manifest["optimizer"].startswith("sgd:lr=0.1")
            assert shard_set.manifest["data_parallel_workers"] == 2
            with pytest.raises(ValueError, match="worker 2 is not one of the 2 the shards expect"):
                layercast.torch.LayerwiseTrainer(shard_set, torch.nn.Module(), stages, worker=2)
            with pytest.raises(ValueError, match="'model.layers.0' is listed twice"):
                layercast.torch.LayerwiseTrainer(shard_set, torch.nn.Module(), stages * 2)


def test_views_are_zero_copy_and_outlive_the_stream(served):
    shards, tensors = served
    with layercast.connect(shards.addresses) as shard_set:
        stream = shard_set.stream([0, 1, 2], budget_bytes=1 << 20)
        layer = next(stream)
        kept = {}
        for name, view in layer.tensors.items():
            tensor = torch.from_dlpack(view)
            start = tensor.data_ptr()
            assert layer.data_ptr <= start < layer.data_ptr + layer.nbytes, "inside the layer"
            assert start == view.data_ptr, "no copy"
            kept[name] = tensor
        del layer
        for _ in stream:  # the stream moves on, and ends
            pass
        stream.close()
    gc.collect()
    for name, tensor in kept.items():  # still the layer's bytes, still right
        assert torch.equal(bits(tensor), bits(expected(tensors, name))), name


def test_a_held_view_holds_its_bytes_and_dropping_it_returns_them(served):
    shards, _ = served
    with layercast.connect(shards.addresses) as shard_set:
        layers = shard_set.manifest["layers"]
        block = [l["index"] for l in layers if l["name"].startswith("model.layers.")]
        budget = layers[block[0]]["nbytes"]  # room for one block at a time
        stream = shard_set.stream(block[:2], budget_bytes=budget, lookahead=0)
        view = torch.from_dlpack(next(stream).tensors[
            next(iter(next(iter([layers[block[0]]]))["tensors"]))["name"]])
        gc.collect()
        with pytest.raises(layercast.Error) as held:
            next(stream)
        assert held.value.code == "RESOURCE_EXHAUSTED"
        del view
        gc.collect()
        layer = next(stream)  # its bytes came back
        assert layer.index == block[1]
        assert stream.stats["peak_bytes"] <= budget


def test_bad_use_gets_clear_errors_and_never_crashes(served, tmp_path):
    shards, tensors = served
    with pytest.raises(layercast.Error) as unreachable:
        layercast.connect(["127.0.0.1:1"], timeout=1.0)
    assert unreachable.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert "127.0.0.1:1" in unreachable.value.message
    with pytest.raises(layercast.Error) as reversed_order:
        layercast.connect(list(reversed(shards.addresses)), timeout=5.0)
    assert "order" in reversed_order.value.message

    shard_set = layercast.connect(shards.addresses)
    with pytest.raises(layercast.Error) as too_small:
        shard_set.stream([0], budget_bytes=16)
    assert too_small.value.code == "RESOURCE_EXHAUSTED"
    with pytest.raises(layercast.Error) as no_layer:
        shard_set.stream([999], budget_bytes=1 << 20)
    assert "999" in no_layer.value.message

    layer = next(shard_set.stream([0], budget_bytes=1 << 20))
    name = layer.tensors and next(iter(layer.tensors))
    view = layer[name]
    shard_set.close()
    assert shard_set.closed
    with pytest.raises(layercast.Error) as closed:
        shard_set.stream([0], budget_bytes=1 << 20)
    assert closed.value.code == "FAILED_PRECONDITION"
    tensor = torch.from_dlpack(view)  # after close: still the layer's bytes
    del layer, view
    gc.collect()
    assert torch.equal(bits(tensor), bits(expected(tensors, name)))
    with pytest.raises(KeyError):
        next(layercast.connect(shards.addresses).stream([0], budget_bytes=1 << 20))["nope"]


def test_pushed_gradients_step_the_master_on_the_shards(model, tmp_path):
    directory, tensors = model
    with ShardSet(tmp_path, 2, ["--model", str(directory), "--policy", POLICY,
                                "--optimizer", "sgd:lr=1", "--data-parallel-workers", "1"]) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            layer = next(shard_set.stream([1], budget_bytes=1 << 20))
            gradients, masters = {}, {}
            g = torch.Generator().manual_seed(11)
            for name, view in layer.tensors.items():
                weight = torch.from_dlpack(view)
                gradients[name] = (torch.randn(weight.shape, generator=g) * 0.01).to(weight.dtype)
                # SGD with lr=1 on the fp32 master: master - g, g widened exactly.
                masters[name] = tensors[name] - gradients[name].to(torch.float32)
            pushed = shard_set.push_gradients(0, 0, 1, gradients).result()
            assert pushed["applied"] and pushed["layer_version"] == 1
            after = next(shard_set.stream([1], budget_bytes=1 << 20, min_version=1))
            assert after.version == 1
            for name, view in after.tensors.items():
                want = masters[name] if "norm" in name else masters[name].to(torch.bfloat16)
                assert torch.equal(bits(torch.from_dlpack(view)), bits(want)), name
            # A layer of one element: shard 0 owns none of it, and still
            # counts the push (one chunk without data), so the step applies.
            tiny = next(l["index"] for l in shard_set.manifest["layers"]
                        if l["name"] == "model.layers.3")
            name = "model.layers.3.layer_scale"
            grad = torch.tensor([0.5], dtype=torch.bfloat16)
            pushed = shard_set.push_gradients(0, 0, tiny, {name: grad}).result()
            assert pushed["applied"] and pushed["layer_version"] == 1
            after = next(shard_set.stream([tiny], budget_bytes=1 << 20, min_version=1))
            want = (tensors[name] - grad.to(torch.float32)).to(torch.bfloat16)
            assert torch.equal(bits(torch.from_dlpack(after[name])), bits(want))
            # Counted once already: the push is reported so (a restarted
            # worker rejoins its step this way) and nothing applies again.
            again = shard_set.push_gradients(0, 0, 1, gradients).result()
            assert not again["applied"]
            assert next(shard_set.stream([1], budget_bytes=1 << 20)).version == 1
            with pytest.raises(TypeError):
                shard_set.push_gradients(1, 0, 1, {n: t.to(torch.float16) if t.dtype == torch.bfloat16
                                                   else t for n, t in gradients.items()})


def test_fp8_layers_train_from_float32_gradients(model, tmp_path):
    """A layer served in fp8 takes its gradient in float32 (the manifest's
    grad_dtype) and the shards step its fp32 master. Half of each master as
    its gradient, with lr=1: the master halves exactly, so every code stays
    and every scale halves; a gradient misplaced or cut to 16 bits would move
    codes."""
    directory, tensors = model
    policy = "p=f32,c=float8_e4m3fn,fp8_block=32;*norm*=f32"
    with ShardSet(tmp_path, 2, ["--model", str(directory), "--policy", policy, "--optimizer",
                                "sgd:lr=1", "--data-parallel-workers", "1"]) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            layer = next(shard_set.stream([1], budget_bytes=1 << 20))
            assert any(v.block_size for v in layer.tensors.values())
            entry = shard_set.manifest["layers"][1]
            assert {t["name"]: t["grad_dtype"] for t in entry["tensors"]} == {
                n: "float32" for n in layer.tensors}
            assert entry["grad_nbytes"] > entry["nbytes"]
            with pytest.raises(TypeError):
                shard_set.push_gradients(0, 0, 1, {n: tensors[n].to(torch.bfloat16)
                                                   for n in layer.tensors})
            before = {n: (torch.from_dlpack(v).clone(),
                          torch.from_dlpack(v.scales).clone() if v.block_size else None)
                      for n, v in layer.tensors.items()}
            grads = {n: tensors[n] * 0.5 for n in layer.tensors}
            pushed = shard_set.push_gradients(0, 0, 1, grads).result()
            assert pushed["applied"] and pushed["layer_version"] == 1
            after = next(shard_set.stream([1], budget_bytes=1 << 20, min_version=1))
            assert after.version == 1
            for name, view in after.tensors.items():
                codes, scales = before[name]
                if scales is None:  # a norm, served in float32
                    assert torch.equal(torch.from_dlpack(view), tensors[name] * 0.5), name
                    continue
                assert torch.equal(torch.from_dlpack(view), codes), name
                assert torch.equal(torch.from_dlpack(view.scales), scales * 0.5), name


def test_fp8_tensors_come_as_codes_and_block_scales(model, tmp_path):
    """Under an fp8 policy each tensor is a uint8 view of its codes plus a
    float32 view of its block scales, both zero-copy; each scale is the
    block's absolute maximum over 448 (computed here by torch), and
    dequantize gives every value back within e4m3fn's precision."""
    directory, tensors = model
    policy = "p=f32,c=float8_e4m3fn,fp8_block=32;*norm*=f32"
    with ShardSet(tmp_path, 2, ["--model", str(directory), "--policy", policy]) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            seen = 0
            for layer in shard_set.stream(range(len(shard_set.manifest["layers"])),
                                          budget_bytes=1 << 20):
                for name, view in layer.tensors.items():
                    master = tensors[name]
                    if "norm" in name:
                        assert view.block_size == 0 and view.scales is None, name
                        continue
                    seen += 1
                    assert view.dtype == "float8_e4m3fn" and view.block_size == 32, name
                    codes = torch.from_dlpack(view)
                    assert codes.dtype == torch.uint8 and list(codes.shape) == list(master.shape)
                    assert codes.data_ptr() == view.data_ptr, "a view, not a copy"
                    scales = torch.from_dlpack(view.scales)
                    blocks = (master.numel() + 31) // 32
                    assert scales.dtype == torch.float32 and list(scales.shape) == [blocks]
                    padded = torch.zeros(blocks * 32)
                    padded[: master.numel()] = master.reshape(-1).abs()
                    amax = padded.reshape(blocks, 32).max(dim=1).values
                    want = torch.where(amax > 0, amax / 448, torch.ones(blocks))
                    want = torch.maximum(want, torch.tensor(2.0 ** -126))
                    assert torch.equal(scales, want), name
                    values = dequantize(view)
                    assert values.dtype == torch.float32 and values.shape == master.shape
                    per = scales.repeat_interleave(32)[: master.numel()].reshape(master.shape)
                    # Half a step of e4m3fn's 3-bit mantissa, or of its
                    # subnormals (2^-9 of the scale).
                    bound = torch.maximum(master.abs() / 16, per * 2.0 ** -10)
                    assert bool(((values - master).abs() <= bound).all()), name
                    assert view.scales.block_size == 0 and view.scales.scales is None
            assert seen > 0
