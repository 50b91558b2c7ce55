"""examples/cnn_train.py as its README runs it, in a few steps: a CNN with
BatchNorm and dropout trained through 2 shards matches plain PyTorch bit for
bit (losses, running statistics), and its export is the fp32 master plain
PyTorch trained, in one file or split with an index."""

import pathlib
import sys

import pytest
import torch

import layercast
import layercast.torch
from shards import ShardSet, bits

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import cnn_train as example  # noqa: E402

STEPS = 4


@pytest.fixture()
def served(tmp_path):
    (tmp_path / "model").mkdir()
    layercast.torch.save_safetensors(tmp_path / "model" / "model.safetensors",
                                     example.initial_weights())
    (tmp_path / "shards").mkdir()
    with ShardSet(tmp_path / "shards", 2,
                  ["--model", str(tmp_path / "model")] + example.SHARD_FLAGS) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            yield shard_set, tmp_path


def test_the_example_trains_exactly_and_exports_the_master(served):
    shard_set, tmp_path = served
    losses, model = example.train(shard_set, STEPS, log=lambda _: None)
    want_losses, want_masters, want_model = example.reference(example.initial_weights(), STEPS)
    assert losses == want_losses, "the loss curve, with dropout, bit for bit"
    for (name, got), want in zip(model.named_buffers(), want_model.buffers()):
        assert torch.equal(got, want), name

    one = shard_set.export(str(tmp_path / "cnn.safetensors"))
    assert one["version"] == STEPS and one["tensors"] == len(want_masters)
    split = shard_set.export(str(tmp_path / "split.safetensors"), max_file_bytes=4096)
    assert len(split["files"]) > 2 and split["files"][-1].endswith("split.safetensors.index.json")
    for path in (tmp_path / "cnn.safetensors", tmp_path / "split.safetensors.index.json"):
        weights = layercast.torch.load_safetensors(path)
        assert weights.keys() == want_masters.keys()
        for name, want in want_masters.items():
            assert torch.equal(bits(weights[name]), bits(want)), (path.name, name)

    bf16 = layercast.torch.load_safetensors(
        shard_set.export(str(tmp_path / "bf16.safetensors"), dtype="bfloat16")["files"][0])
    assert bf16["head.weight"].dtype == torch.bfloat16
    assert torch.equal(bits(bf16["head.weight"]), bits(want_masters["head.weight"].bfloat16()))
    with pytest.raises(ValueError, match=r"does not end in \.safetensors"):
        shard_set.export(str(tmp_path / "model.pt"))
    with pytest.raises(ValueError, match="'f64' cannot be exported"):
        shard_set.export(str(tmp_path / "x.safetensors"), dtype="f64")
