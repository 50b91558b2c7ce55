"""The package reads through the shards' own formats, not copies of them:
the 8-bit float table is core/fp8's (checked against a decoder written from
the OCP spec here, and against torch's own float8 dtypes), and safetensors
headers are core/safetensors's reader's, as strict for Python as for a
shard: a file whose tensors overlap is refused, naming the file. Files are
written by core/safetensors's writer too, every dtype save_safetensors
takes, byte for byte as the native writer lays them out."""

import json
import math
import pathlib
import struct

import pytest
import torch

import layercast
import layercast.torch
from layercast import training_state


def ocp_value(code, dtype):
    exponent_bits, mantissa_bits = {"float8_e4m3fn": (4, 3), "float8_e5m2": (5, 2)}[dtype]
    bias = (1 << (exponent_bits - 1)) - 1
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = code & ((1 << mantissa_bits) - 1)
    top = exponent == (1 << exponent_bits) - 1
    if dtype == "float8_e4m3fn" and top and mantissa == (1 << mantissa_bits) - 1:
        return math.nan  # e4m3fn has no infinities, one NaN
    if dtype == "float8_e5m2" and top:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:
        return sign * mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
    return sign * (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - bias)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_the_fp8_table_is_the_ocp_formats(dtype):
    table = layercast.torch._fp8_values(dtype)
    expected = torch.tensor([ocp_value(code, dtype) for code in range(256)], dtype=torch.float32)
    assert torch.equal(table.isnan(), expected.isnan())
    assert torch.equal(table.nan_to_num(), expected.nan_to_num())
    if hasattr(torch, dtype):  # torch's own decoder, where this torch has it
        own = torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype)).float()
        assert torch.equal(table.nan_to_num(), own.nan_to_num())
    with pytest.raises(layercast.Error, match="not an 8-bit float"):
        layercast._layercast.fp8_values("bfloat16")


def test_safetensors_round_trip_in_file_order(tmp_path):
    tensors = {"b.weight": torch.randn(3, 5), "a.bias": torch.randn(7).bfloat16(),
               "steps": torch.tensor([4], dtype=torch.int64), "empty": torch.empty(0, 2)}
    layercast.torch.save_safetensors(tmp_path / "m.safetensors", tensors, {"note": "kept"})
    loaded = layercast.torch.load_safetensors(tmp_path / "m.safetensors")
    assert list(loaded) == list(tensors), "in the order the file holds them"
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert layercast._layercast.safetensors_header(str(tmp_path / "m.safetensors"))[1] == \
        {"note": "kept"}


def test_a_malformed_header_is_refused_naming_the_file(tmp_path):
    header = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},' \
             b'"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}'
    path = tmp_path / "overlap.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))
    with pytest.raises(layercast.Error, match="overlap.safetensors") as refused:
        layercast.torch.load_safetensors(path)
    assert "overlap" in str(refused.value)


def test_save_safetensors_writes_the_native_writers_bytes(tmp_path):
    """The exact file: the native writer's compact header (__metadata__
    first, then the tensors as given, dense offsets, spaces to a multiple of
    8) and each tensor's little-endian bytes, spelled here by hand. A Python
    writer of its own (json.dumps puts spaces after separators and the
    metadata where it was added) would differ."""
    tensors = {
        "w": (torch.tensor([[1.0, -2.5]]), "F32", struct.pack("<2f", 1.0, -2.5)),
        "half": (torch.tensor([1.0, -2.5]).half(), "F16", bytes.fromhex("003c00c1")),
        "brain": (torch.tensor([1.0, -2.5]).bfloat16(), "BF16", bytes.fromhex("803f20c0")),
        "step": (torch.tensor(4, dtype=torch.int64), "I64", struct.pack("<q", 4)),
        "ids": (torch.tensor([[7, -8, 9]], dtype=torch.int32), "I32", struct.pack("<3i", 7, -8, 9)),
        "small": (torch.tensor([-3], dtype=torch.int16), "I16", struct.pack("<h", -3)),
        "tiny": (torch.tensor([-1, 2], dtype=torch.int8), "I8", bytes([0xFF, 2])),
        "bytes": (torch.tensor([255], dtype=torch.uint8), "U8", bytes([255])),
        "mask": (torch.tensor([True, False, True]), "BOOL", bytes([1, 0, 1])),
        "none": (torch.empty(0, 2), "F32", b""),
        # Not contiguous: written as its elements in C order.
        "t": (torch.arange(4, dtype=torch.int64).reshape(2, 2).t(), "I64",
              struct.pack("<4q", 0, 2, 1, 3)),
    }
    path = tmp_path / "m.safetensors"
    layercast.torch.save_safetensors(path, {name: t for name, (t, _, _) in tensors.items()},
                                     {"note": "kept"})
    assert path.read_bytes() == native_file(tensors, {"note": "kept"})


def native_file(tensors, metadata):
    """The bytes the native writer lays `tensors` ({name: (tensor, tag,
    raw bytes)}) out as, with `metadata`."""
    header, data, offset = {"__metadata__": metadata}, b"", 0
    for name, (tensor, tag, raw) in tensors.items():
        header[name] = {"dtype": tag, "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data


def test_a_split_state_is_the_native_split_and_index(tmp_path):
    """save_optimizer_state's and export_checkpoint's split is the one
    ShardSet.export writes (core/safetensors_split): a new file when the
    next tensor would take a non-empty one past the limit, a tensor over it
    alone, "<stem>-0000i-of-0000N", and Hugging Face's index (total_size
    only, indented by 2, a final newline) written natively. Python's own
    split wrote the files' metadata into the index and no newline."""
    tensors = {
        "a": (torch.tensor([1.0, 2.0]), "F32", struct.pack("<2f", 1.0, 2.0)),
        "b": (torch.tensor([3.0]), "F32", struct.pack("<f", 3.0)),
        "c": (torch.arange(6, dtype=torch.float32), "F32", struct.pack("<6f", *range(6))),
        "d": (torch.tensor(5, dtype=torch.int64), "I64", struct.pack("<q", 5)),
    }
    metadata = {"format": "torch-optimizer-state", "note": "every file's"}
    path = tmp_path / "optimizer.safetensors"
    given = {name: tensor for name, (tensor, _, _) in tensors.items()}
    files = training_state._write(path, given, metadata, max_file_bytes=16)
    parts = [["a", "b"], ["c"], ["d"]]
    names = [f"optimizer-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert files == [str(tmp_path / name) for name in names] + [f"{path}.index.json"]
    for name, part in zip(names, parts):
        assert (tmp_path / name).read_bytes() == native_file(
            {t: tensors[t] for t in part}, metadata), name
    weight_map = ",\n".join(f'    "{t}": "{name}"' for name, part in zip(names, parts)
                            for t in part)
    assert pathlib.Path(files[-1]).read_text() == (
        '{\n  "metadata": {\n    "total_size": 44\n  },\n  "weight_map": {\n' + weight_map +
        "\n  }\n}\n")
    assert not path.exists()
    # Under the limit: the one file, no index.
    assert training_state._write(path, given, metadata, 44) == [str(path)]
    assert path.read_bytes() == native_file(tensors, metadata)


def test_save_safetensors_is_refused_as_the_native_writer_refuses(tmp_path):
    """A name the format reserves is refused by the native writer, naming
    the file, before anything is written; dtypes the shards cannot serve are
    refused in Python first."""
    path = tmp_path / "reserved.safetensors"
    with pytest.raises(layercast.Error, match="reserved.safetensors.*'__metadata__' cannot name"):
        layercast.torch.save_safetensors(path, {"__metadata__": torch.zeros(1)})
    assert not path.exists()
    with pytest.raises(TypeError, match="float64"):
        layercast.torch.save_safetensors(path, {"w": torch.zeros(1, dtype=torch.float64)})
