"""The package as Python users expect it, against real shards: errors with a
clean str() and a code, IndexError for a layer outside the model, a layer
as a read-only mapping, shapes as tuples, a mirror that raises instead
of waiting for itself when asked for its lock from inside a reading, the
library's log lines in Python's logging, and bfloat16 for numpy."""

import inspect
import logging
import threading
import time

import numpy
import pytest
import torch

import layercast
import layercast.torch
from shards import ShardSet, llama_tensors


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("model")
    tensors = llama_tensors(layers=2)
    layercast.torch.save_safetensors(directory / "model.safetensors", tensors)
    with ShardSet(tmp_path_factory.mktemp("shards"), 2,
                  ["--model", str(directory), "--policy", "p=f32,c=bf16"]) as shards:
        yield shards


@pytest.fixture(scope="module")
def shard_set(served):
    with layercast.connect(served.addresses) as connected:
        yield connected


def test_the_library_logs_through_pythons_logging(served, caplog, capfd):
    caplog.set_level(logging.INFO, logger="layercast")
    with layercast.connect(served.addresses):
        pass
    # Read from the library's pipe on the package's own thread.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
            "connected to 2 shard(s)" in record.getMessage() for record in caplog.records):
        time.sleep(0.05)
    connected = [record for record in caplog.records
                 if "connected to 2 shard(s)" in record.getMessage()]
    assert connected and connected[0].name == "layercast"
    assert connected[0].levelno == logging.INFO
    assert "connected to" not in capfd.readouterr().err, "not straight to stderr"


def test_numpy_takes_a_bfloat16_tensor_as_its_bits(shard_set):
    layer = next(shard_set.stream([1], budget_bytes=1 << 20))
    name, tensor = next(iter(layer.items()))
    assert tensor.dtype == "bfloat16"
    bits = numpy.from_dlpack(tensor.bits())
    assert bits.dtype == numpy.uint16 and bits.shape == tensor.shape
    assert tensor.bits().dtype == "uint16"
    widened = (bits.astype(numpy.uint32) << 16).view(numpy.float32)
    assert numpy.array_equal(widened, torch.from_dlpack(tensor).float().numpy()), name
    assert bits.ctypes.data == tensor.data_ptr, "the layer's memory, not a copy"


def test_errors_read_cleanly_and_a_layer_outside_the_model_is_an_index_error(shard_set):
    layers = len(shard_set.manifest["layers"])
    with pytest.raises(IndexError) as outside:
        shard_set.stream([0, layers], budget_bytes=1 << 20)
    assert isinstance(outside.value, layercast.Error), "still a layercast.Error"
    assert outside.value.code == "NOT_FOUND"
    assert str(outside.value) == (f"layer {layers} does not exist: this model has {layers} "
                                  f"layers (0-{layers - 1}) (NOT_FOUND)")
    with pytest.raises(layercast.Error) as too_small:
        shard_set.stream([0], budget_bytes=16)
    assert str(too_small.value).endswith("(RESOURCE_EXHAUSTED)")
    assert not str(too_small.value).startswith("("), "not a tuple"


def test_a_layer_is_a_read_only_mapping_with_tuple_shapes(shard_set):
    layer = next(shard_set.stream([1], budget_bytes=1 << 20))
    tensors = dict(layer)
    assert list(tensors) == list(layer) and len(layer) == len(tensors) > 0
    manifest = {t["name"]: t for t in shard_set.manifest["layers"][1]["tensors"]}
    for name, tensor in layer.items():
        assert isinstance(tensor.shape, tuple), name
        assert tensor.shape == tuple(manifest[name]["shape"]), name
    assert next(iter(layer)) in layer and "nope" not in layer
    with pytest.raises(KeyError):
        layer["nope"]
    with pytest.raises(TypeError):
        layer["x"] = None  # read-only


def test_a_mirror_asked_for_its_lock_inside_a_reading_raises(shard_set):
    with shard_set.mirror() as mirror:
        with mirror.read() as reading:
            held = reading.version
            for ask in (lambda: mirror.version, mirror.update, mirror.read,
                        lambda: mirror.wait_for_version(0, timeout=0.1)):
                with pytest.raises(RuntimeError, match="inside `with mirror.read"):
                    ask()
            with pytest.raises(IndexError):
                reading.layer(len(reading))
            # Another thread is not inside the reading: it waits, as before.
            seen = []
            other = threading.Thread(target=lambda: seen.append(mirror.version))
            other.start()
        other.join(timeout=10)
        assert seen == [held]
        assert mirror.version == held, "after the block, asked freely"


def test_a_message_names_the_python_arguments_to_change():
    with pytest.raises(layercast.Error) as unreachable:
        layercast.connect(["127.0.0.1:1"], timeout=0.3)
    assert unreachable.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert "connect()'s timeout" in unreachable.value.message
    assert "--connect-timeout-ms" not in unreachable.value.message
    assert "--shards" not in unreachable.value.message


def test_signatures_take_the_worker_librarys_defaults_through_the_binding():
    defaults = layercast._layercast.defaults
    # client/client_defaults.h's, in seconds.
    assert (defaults.layer_timeout, defaults.connect_timeout, defaults.publish_timeout,
            defaults.mirror_poll, defaults.mirror_probe) == (60.0, 30.0, 120.0, 10.0, 0.5)
    for function, argument, name in [
            (layercast.ShardSet.stream, "timeout", "layer_timeout"),
            (layercast.ShardSet.export, "timeout", "layer_timeout"),
            (layercast.ShardSet.mirror, "timeout", "layer_timeout"),
            (layercast.ShardSet.mirror, "poll", "mirror_poll"),
            (layercast.ShardSet.mirror, "probe", "mirror_probe"),
            (layercast.ShardSet.publish, "timeout", "publish_timeout"),
            (layercast.connect, "timeout", "connect_timeout"),
            (layercast.torch.LayerwiseTrainer.__init__, "timeout", "layer_timeout")]:
        parameter = inspect.signature(function).parameters[argument]
        assert parameter.default == getattr(defaults, name), (function.__qualname__, argument)
