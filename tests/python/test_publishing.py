"""Publishing from Python to real read-only shards on 127.0.0.1, and a mirror
following it: after each publish the mirror holds, in place and without a
copy, exactly torch's casts of the new values; bad publishes raise and change
nothing."""

import os
import threading

import pytest
import torch

import layercast
from layercast.torch import save_safetensors
from shards import ShardSet, bits, llama_tensors

# fp8_block=32: a pull in fp8 (the fleet's) keeps blocks within each
# shard's half of a 64-element norm.
POLICY = "p=f32,c=bf16,fp8_block=32;*norm*=f32"
TOKEN = "python-publish-token-0123456789abcdef"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("publish")
    tensors = llama_tensors()
    save_safetensors(directory / "model.safetensors", tensors)
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o600)
    with ShardSet(directory, 2, ["--model", str(directory), "--policy", POLICY,
                                 "--admin-token-file", str(token_file)]) as shards:
        yield shards, tensors


def cast(tensor, name):
    return tensor if "norm" in name else tensor.to(torch.bfloat16)


def test_a_mirror_follows_publishes_in_place(served):
    shards, tensors = served
    with layercast.connect(shards.addresses) as shard_set:
        mirror = shard_set.mirror(poll=20.0)
        start = mirror.version
        views = {}
        with mirror.read() as reading:
            assert reading.version == start
            for index in range(len(reading)):
                for name, view in reading.layer(index).tensors.items():
                    views[name] = torch.from_dlpack(view)
        assert set(views) == set(tensors)
        nbytes = sum(v.numel() * v.element_size() for v in views.values())
        updates = []
        done = threading.Event()

        def on_update(update):
            updates.append(update)
            done.set()

        mirror.follow(on_update)
        values = {name: t.clone() for name, t in tensors.items()}
        for step in range(1, 3):
            for t in values.values():
                t.view(-1)[step::5] *= 1 + 1 / 16
            # The token as a file gives it, newline and all.
            published = shard_set.publish(values, token_text(shards), insecure=True)
            assert published["version"] == start + step
            assert published["changed_elements"] > 0
            assert not published["layer_by_layer"]
            assert mirror.wait_for_version(start + step, timeout=30)
            with mirror.read() as reading:
                reading.check()
                assert reading.version == start + step
            for name, view in views.items():  # the same memory, new values
                assert torch.equal(bits(view), bits(cast(values[name], name))), name
        mirror.stop()
        assert done.is_set()
        assert [u["version"] for u in updates] == [start + 1, start + 2]
        for update in updates:
            assert 0 < update["bytes"] < nbytes, "a delta, not the whole model"
        assert mirror.update()["layers"] == 0, "nothing new to pull"
        # A publish moves every layer's version; the update names the
        # layers whose values changed. The one-element layer_scale never
        # did above ([step::5] of one element is empty).
        names = [layer["name"] for layer in shard_set.manifest["layers"]]
        for update in updates:
            assert update["changed_layers"] == [n for n in names if n != "model.layers.3"]
        values["model.layers.1.mlp.up_proj.weight"] *= 2
        shard_set.publish(values, TOKEN, insecure=True)
        update = mirror.update()
        assert update["layers"] == len(names)
        assert update["changed_layers"] == ["model.layers.1"]
        with mirror.read() as reading:
            assert reading.names() == names
            up = reading["model.layers.1"]["model.layers.1.mlp.up_proj.weight"]
            assert torch.equal(bits(torch.from_dlpack(up)),
                               bits(cast(values["model.layers.1.mlp.up_proj.weight"],
                                         "model.layers.1.mlp.up_proj.weight")))
            with pytest.raises(KeyError, match="no layer 'model.layers.9'"):
                reading["model.layers.9"]


def test_a_bad_publish_raises_and_changes_nothing(served):
    shards, tensors = served
    with layercast.connect(shards.addresses) as shard_set:
        before = shard_set.mirror()
        version = before.version
        name = "model.layers.0.self_attn.q_proj.weight"
        with pytest.raises(TypeError, match="float32"):
            shard_set.publish({name: tensors[name].double()}, TOKEN, insecure=True)
        with pytest.raises(ValueError, match="shape"):
            shard_set.publish({name: tensors[name].view(-1)}, TOKEN, insecure=True)
        with pytest.raises(KeyError, match="not in the model"):
            shard_set.publish({"no.such.weight": torch.zeros(1)}, TOKEN, insecure=True)
        with pytest.raises(layercast.Error) as partial:
            shard_set.publish({name: tensors[name]}, TOKEN, insecure=True)
        assert partial.value.code == "INVALID_ARGUMENT"
        assert "given in part" in partial.value.message
        with pytest.raises(layercast.Error) as refused:
            shard_set.publish(dict(tensors), "not-the-token-0123456789abcdef",
                              insecure=True)
        assert refused.value.code in ("UNAUTHENTICATED", "PERMISSION_DENIED")
        after = shard_set.mirror()
        assert after.version == version
        with before.read() as old, after.read() as new:
            for index in range(len(old)):
                for tensor_name, view in old.layer(index).tensors.items():
                    assert torch.equal(bits(torch.from_dlpack(view)),
                                       bits(torch.from_dlpack(new.layer(index)[tensor_name])))


def token_text(shards):
    with open(shards.directory / "token") as f:
        return f.read()


def test_a_token_is_checked_before_anything_is_sent(served, capfd):
    shards, tensors = served
    with layercast.connect(shards.addresses) as shard_set:
        version = shard_set.version()
        with pytest.raises(layercast.Error) as clear_text:
            shard_set.publish(dict(tensors), token_text(shards))
        assert clear_text.value.code == "INVALID_ARGUMENT"
        assert "clear text" in clear_text.value.message
        assert "insecure" in clear_text.value.message
        # A newline inside: gRPC aborted the process on such a header.
        bad = TOKEN[:10] + "\n" + TOKEN[10:]
        with pytest.raises(layercast.Error) as invalid:
            shard_set.publish(dict(tensors), bad, insecure=True)
        assert invalid.value.code == "INVALID_ARGUMENT"
        assert "control character" in invalid.value.message
        assert shard_set.version() == version
    # A worker's token, likewise, before the connection is made.
    with pytest.raises(layercast.Error) as worker_clear_text:
        layercast.connect(shards.addresses, worker_token=token_text(shards))
    assert worker_clear_text.value.code == "INVALID_ARGUMENT"
    assert "insecure=True" in worker_clear_text.value.message
    captured = capfd.readouterr()
    for text in (str(clear_text.value), str(invalid.value), str(worker_clear_text.value),
                 captured.out, captured.err):
        assert TOKEN[10:] not in text, "a message printed the token"


def test_a_pinned_walk_gets_its_version_while_newer_ones_commit(served):
    shards, tensors = served
    with layercast.connect(shards.addresses) as shard_set:
        start = shard_set.version()
        layers = len(shard_set.manifest["layers"])
        held = {}
        for layer in shard_set.stream(range(layers), budget_bytes=1 << 24):
            held.update({name: torch.from_dlpack(t).clone() for name, t in layer.tensors.items()})
        walk = shard_set.stream(range(layers), budget_bytes=1 << 24, lookahead=0, version=start)
        first = next(walk)
        assert first.version == start
        newer = {name: t * 1.25 for name, t in tensors.items()}
        assert shard_set.publish(newer, TOKEN, insecure=True)["version"] == start + 1
        seen = [first] + list(walk)
        assert [layer.index for layer in seen] == list(range(layers))
        for layer in seen:
            assert layer.version == start, "the walk left its version"
            for name, view in layer.tensors.items():
                assert torch.equal(bits(torch.from_dlpack(view)), bits(held[name])), name
        for layer in shard_set.stream(range(layers), budget_bytes=1 << 24):
            assert layer.version == start + 1
            for name, view in layer.tensors.items():
                assert torch.equal(bits(torch.from_dlpack(view)), bits(cast(newer[name], name)))


def test_an_fp8_mirror_follows_shards_that_serve_bf16(served):
    shards, tensors = served
    with layercast.connect(shards.addresses) as shard_set:
        # Staged: pulled beside what readers read, swapped in whole.
        fleet = shard_set.mirror(dtype="float8_e4m3fn", staging_bytes=1 << 30)
        start = fleet.version
        up = "model.layers.0.mlp.up_proj.weight"
        with fleet.read() as reading:
            assert reading["model.layers.0"][up].dtype == "float8_e4m3fn"
            assert reading["model.layers.0"][up].block_size == 32
        newer = {name: t * 1.5 for name, t in tensors.items()}
        assert shard_set.publish(newer, TOKEN, insecure=True)["version"] == start + 1
        update = fleet.update()
        assert update["version"] == start + 1
        assert update["staged_layers"] == len(shard_set.manifest["layers"])
        assert 0 <= update["pause_seconds"] <= update["seconds"]
        # In place, and exactly what a fresh pull in fp8 gives.
        fresh = shard_set.mirror(dtype="float8_e4m3fn")
        with fleet.read() as followed, fresh.read() as pulled:
            for layer in followed.names():
                for name, tensor in followed[layer].items():
                    other = pulled[layer][name]
                    assert torch.equal(torch.from_dlpack(tensor), torch.from_dlpack(other)), name
                    assert torch.equal(torch.from_dlpack(tensor.scales),
                                       torch.from_dlpack(other.scales)), name
            values = layercast.torch.dequantize(followed["model.layers.0"][up])
            assert torch.allclose(values, newer[up], rtol=1 / 8, atol=1e-6)
        with shard_set.mirror() as bf16:
            with bf16.read() as reading:
                assert reading["model.layers.0"][up].dtype == "bfloat16", "trainers' pulls"
        with pytest.raises(ValueError, match="'float64' is not one the shards cast to"):
            shard_set.mirror(dtype="float64")


def test_a_mirror_serves_an_fp8_fleet_below_it(served):
    shards, tensors = served
    with layercast.connect(shards.addresses) as shard_set:
        with pytest.raises(ValueError, match="give one per shard, 2"):
            shard_set.mirror(serve=["127.0.0.1:0"])
        relay = shard_set.mirror(dtype="float8_e4m3fn", serve=["127.0.0.1:0"] * 2)
        assert len(relay.addresses) == 2
        with layercast.connect(relay.addresses) as relayed:
            # The relay's manifest lists what it holds; the shards', the policy's.
            held, own = relayed.manifest, shard_set.manifest
            assert held["held_dtype"] == "float8_e4m3fn" and own["held_dtype"] is None
            assert held["policy"] == own["policy"]
            assert [t["name"] for layer in held["layers"] for t in layer["tensors"]] == \
                [t["name"] for layer in own["layers"] for t in layer["tensors"]]
            # nbytes as held too: fp8 codes and block scales, well under bfloat16.
            assert sum(l["nbytes"] for l in held["layers"]) < \
                sum(l["nbytes"] for l in own["layers"]) * 3 // 4
            for layer, shards_layer in zip(held["layers"], own["layers"]):
                for tensor, shards_tensor in zip(layer["tensors"], shards_layer["tensors"]):
                    policy = "float32" if "norm" in tensor["name"] else "bfloat16"
                    assert tensor["dtype"] == "float8_e4m3fn", tensor["name"]
                    assert shards_tensor["dtype"] == policy, tensor["name"]
                    assert tensor["policy_dtype"] == shards_tensor["policy_dtype"] == policy
            child = relayed.mirror(dtype="float8_e4m3fn")
            newer = {name: t * 0.75 for name, t in tensors.items()}
            version = shard_set.publish(newer, TOKEN, insecure=True)["version"]
            assert relay.update()["version"] == version
            assert child.update()["version"] == version
            with relay.read() as above, child.read() as below:
                for layer in above.names():
                    for name, tensor in above[layer].items():
                        other = below[layer][name]
                        assert torch.equal(torch.from_dlpack(tensor), torch.from_dlpack(other))
                        assert torch.equal(torch.from_dlpack(tensor.scales),
                                           torch.from_dlpack(other.scales)), name
            # A relay serves the dtype it holds, and says where to get others.
            with pytest.raises(layercast.Error, match="from the shards"):
                relayed.mirror()
