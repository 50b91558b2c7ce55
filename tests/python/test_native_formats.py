"""The package reads through the shards' own formats, not copies of them:
the 8-bit float table is core/fp8's (checked against a decoder written from
the OCP spec here, and against torch's own float8 dtypes), and safetensors
headers are core/safetensors's reader's, as strict for Python as for a
shard: a file whose tensors overlap is refused, naming the file."""

import math
import struct

import pytest
import torch

import layercast
import layercast.torch


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
