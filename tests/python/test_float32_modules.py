"""A policy that keeps LayerNorms in float32 inside a bfloat16 model
(`*ln*=f32`): the stages cast each Linear's and LayerNorm's input to its
weight's dtype, as autocast does, so a model written without casts runs,
and equals plain PyTorch with the casts written out; a module of the
user's own with the same mismatch is named in the error."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layercast
import layercast.torch
from shards import ShardSet

POLICY = "p=f32,c=bf16,o=f32;*ln*=f32"
WIDTH = 16


class OwnNorm(nn.Module):
    """A norm of the user's own: no cast applies to it."""

    def __init__(self, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH, device=device))

    def forward(self, x):
        return F.layer_norm(x, (WIDTH,), self.weight)


class Block(nn.Module):
    def __init__(self, norm, device=None):
        super().__init__()
        self.ln = norm(device=device)
        self.fc = nn.Linear(WIDTH, WIDTH, device=device)

    def forward(self, x):
        return x + self.fc(self.ln(x))


def layer_norm(device=None):
    return nn.LayerNorm(WIDTH, device=device)


class Net(nn.Module):
    def __init__(self, norm=layer_norm, device=None):
        super().__init__()
        self.embed = nn.Linear(8, WIDTH, device=device)
        self.blocks = nn.ModuleList([Block(norm, device)])
        self.final_ln = norm(device)
        self.head = nn.Linear(WIDTH, 4, device=device)

    def stages(self):
        return [("embed", self.embed), ("blocks.0", self.blocks[0]),
                ("final", lambda x: self.head(self.final_ln(x)))]


def serve(tmp_path, weights, optimizer):
    (tmp_path / "model").mkdir()
    layercast.torch.save_safetensors(tmp_path / "model" / "model.safetensors", weights)
    (tmp_path / "shards").mkdir()
    flags = ["--model", str(tmp_path / "model"), "--policy", POLICY, "--layer-regex",
             r"^blocks\.(\d+)\.", "--first-layer-prefix", "embed."]
    return ShardSet(tmp_path / "shards", 2, flags + (["--optimizer", "adamw:lr=1e-3"]
                                                     if optimizer else []))


def test_layernorms_in_float32_inside_a_bf16_model_run_as_with_the_casts_written(tmp_path):
    torch.manual_seed(1)
    weights = {n: t.detach().clone() for n, t in Net().named_parameters()}
    x = torch.randn(3, 8)
    targets = torch.tensor([0, 1, 3])
    with serve(tmp_path, weights, optimizer=True) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            model = Net(device="meta")
            trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages())
            got = trainer.forward(x)
            loss = trainer.train_step(x, targets, F.cross_entropy)
    reference = Net()
    compute = {n: (t if ".ln." in n or n.startswith("final_ln") else t.bfloat16())
               for n, t in weights.items()}
    with torch.no_grad(), layercast.torch.bound(reference, compute):
        h = reference.embed(x.bfloat16())
        block = reference.blocks[0]
        h = h + block.fc(block.ln(h.float()).bfloat16())
        want = reference.head(reference.final_ln(h.float()).bfloat16()).float()
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    assert loss == F.cross_entropy(want, targets).item()


def test_a_module_of_ones_own_with_the_mismatch_is_named(tmp_path):
    torch.manual_seed(1)
    weights = {n: t.detach().clone() for n, t in Net(OwnNorm).named_parameters()}
    with serve(tmp_path, weights, optimizer=False) as shards:
        with layercast.connect(shards.addresses) as shard_set:
            model = Net(OwnNorm, device="meta")
            trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages())
            with pytest.raises(TypeError, match=r"stage 'blocks\.0': module 'blocks\.0\.ln' "
                                                r"\(OwnNorm, parameters \['torch\.float32'\]\)"):
                trainer.forward(torch.randn(3, 8))
