"""The loop shape PyTorch users know, against real shards: trainer(inputs),
loss.backward() per micro batch (gradients added up on the worker), then
step(); the result is plain PyTorch's gradient accumulation bit for bit
(losses, running statistics, and the exported fp32 master). The learning
rate schedule is read back from the shards, and a worker left alone on a
2-worker set is told which worker it waits for."""

import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

import layercast
import layercast.torch
from shards import ShardSet, bits

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import cnn_train as example  # noqa: E402

STEPS, MICRO = 2, 3


def serve(tmp_path, flags):
    (tmp_path / "model").mkdir(exist_ok=True)
    layercast.torch.save_safetensors(tmp_path / "model" / "model.safetensors",
                                     example.initial_weights())
    (tmp_path / "shards").mkdir(exist_ok=True)
    return ShardSet(tmp_path / "shards", 2, ["--model", str(tmp_path / "model")] + flags)


def test_backward_and_step_accumulate_as_plain_pytorch_does(tmp_path):
    with serve(tmp_path, example.SHARD_FLAGS) as shards, \
            layercast.connect(shards.addresses) as shard_set:
        model = example.Net(device="meta")
        trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(),
                                                   buffers=example.fresh_buffers())
        with pytest.raises(RuntimeError, match="step\\(\\) with no gradients"):
            trainer.step()
        torch.manual_seed(0)
        losses = []
        for step in range(STEPS):
            for micro in range(MICRO):
                loss = F.cross_entropy(trainer(example.batch(step * MICRO + micro)[0]),
                                       example.batch(step * MICRO + micro)[1]) / MICRO
                loss.backward()
                losses.append(loss.item())
            if step == 0:
                with pytest.raises(RuntimeError, match="waiting for step\\(\\)"):
                    trainer.train_step(*example.batch(0), F.cross_entropy)
            trainer.step()
        want_losses, want_masters, want_model = example.reference(example.initial_weights(),
                                                                  STEPS, micro=MICRO)
        assert losses == want_losses
        for (name, got), want in zip(model.named_buffers(), want_model.buffers()):
            assert torch.equal(got, want), name
        assert trainer.version == STEPS
        exported = layercast.torch.load_safetensors(
            shard_set.export(str(tmp_path / "m.safetensors"))["files"][0])
        for name, want in want_masters.items():
            assert torch.equal(bits(exported[name]), bits(want)), name

        # An output whose step has gone cannot be back-propagated any more.
        stale = trainer(example.batch(0)[0]).sum()
        trainer(example.batch(1)[0]).sum().backward()
        trainer.step()
        with pytest.raises(RuntimeError, match="run backward\\(\\) on each output before"):
            stale.backward()


def test_the_schedule_is_read_back_and_a_missing_worker_is_named(tmp_path):
    optimizer = "adamw:lr=0.01,warmup_steps=4,decay_steps=10,min_lr=0.001"
    flags = ["--policy", example.POLICY, "--optimizer", optimizer, "--layer-regex",
             r"^blocks\.(\d+)\.", "--first-layer-prefix", "", "--data-parallel-workers", "2"]
    with serve(tmp_path, flags) as shards, layercast.connect(shards.addresses) as shard_set:
        model = example.Net(device="meta")
        trainer = layercast.torch.LayerwiseTrainer(shard_set, model, model.stages(),
                                                   buffers=example.fresh_buffers(), timeout=2.0)
        assert trainer.learning_rate == pytest.approx(0.01 / 4)
        assert layercast.learning_rate(optimizer, 4) == pytest.approx(0.01)
        assert layercast.learning_rate(optimizer, 14) == pytest.approx(0.001)
        with pytest.raises(ValueError, match="lr"):
            layercast.learning_rate("adamw:lr=-1", 1)
        trainer.train_step(*example.batch(0), F.cross_entropy)
        assert trainer.learning_rate == pytest.approx(0.01 / 2)
        # Worker 1 never comes: the next gather says so.
        with pytest.raises(layercast.Error, match=r"waits for the push of worker 1 of the 2 .*"
                                                  r"worker 0 pushed") as waited:
            trainer.forward(example.batch(1)[0])
        assert waited.value.code == "DEADLINE_EXCEEDED"
