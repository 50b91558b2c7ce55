"""A model with buffers (a small CNN with BatchNorm, built on the meta
device) trained through layercast: its buffers live with the worker, the
loss curve and the running statistics match plain PyTorch bit for bit, and
a model whose buffers are left on the meta device is refused at once."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layercast
import layercast.torch
from shards import ShardSet

STEPS = 4
LR = 0.05
CLASSES = 3
FLAGS = ["--policy", "params=float32,compute=float32,output=float32", "--optimizer",
         f"sgd:lr={LR}", "--layer-regex", r"^blocks\.(\d+)\.", "--first-layer-prefix", ""]


class Block(nn.Module):
    def __init__(self, channels_in, channels_out, device=None):
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False, device=device)
        self.bn = nn.BatchNorm2d(channels_out, device=device)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.blocks = nn.ModuleList([Block(1, 4, device), Block(4, 4, device)])
        self.head = nn.Linear(4, CLASSES, device=device)

    def stages(self):
        return [("blocks.0", self.blocks[0]), ("blocks.1", self.blocks[1]),
                ("final", lambda x: self.head(x.mean(dim=(2, 3))))]


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, CLASSES, (8,), generator=g)


def reference(weights):
    """Plain PyTorch: one model on the CPU, torch.optim.SGD(foreach=False)."""
    model = Net()
    masters = {name: tensor.clone().requires_grad_() for name, tensor in weights.items()}
    optimizer = torch.optim.SGD(list(masters.values()), lr=LR, foreach=False)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, targets = batch(step)
        with layercast.torch.bound(model, masters):
            x = inputs
            for _, fn in model.stages():
                x = fn(x)
            loss = F.cross_entropy(x, targets)
            loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, dict(model.named_buffers())


@pytest.fixture()
def served(tmp_path):
    torch.manual_seed(11)
    weights = {name: tensor.detach().clone() for name, tensor in Net().named_parameters()}
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    layercast.torch.save_safetensors(model_dir / "model.safetensors", weights)
    (tmp_path / "shards").mkdir()
    with ShardSet(tmp_path / "shards", 2, ["--model", str(model_dir)] + FLAGS) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            yield shard_set, weights


def test_buffers_stay_with_the_worker_and_match_plain_pytorch_bit_for_bit(served):
    shard_set, weights = served
    model = Net(device="meta")
    buffers = dict(Net().named_buffers())  # zeros and ones, as a fresh model's
    trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(), buffers=buffers)
    losses = [trainer.train_step(*batch(step), F.cross_entropy) for step in range(STEPS)]
    want_losses, want_buffers = reference(weights)
    assert losses == want_losses, "the loss curve, bit for bit"
    got = dict(model.named_buffers())
    assert int(got["blocks.0.bn.num_batches_tracked"]) == STEPS, "one update a step, not two"
    for name, want in want_buffers.items():
        assert torch.equal(got[name], want), name
    assert "blocks.0.bn.running_mean" not in {
        t["name"] for layer in shard_set.manifest["layers"] for t in layer["tensors"]}


def test_buffers_left_on_the_meta_device_are_named(served):
    shard_set, _ = served
    model = Net(device="meta")
    with pytest.raises(ValueError, match=r"blocks\.0\.bn\.running_mean.*buffers="):
        layercast.torch.LayerwiseTrainer(shard_set, model, model.stages())
    with pytest.raises(KeyError, match="no buffers"):
        layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(),
                                         buffers={"blocks.9.bn.running_mean": torch.zeros(4)})
