#!/usr/bin/env python3
"""The model tests/deploy/image_test.sh mounts into the image, and the check
of what a worker fetched from it. Standard library only.

  image_test_model.py write DIR
      writes DIR/model.safetensors: a small Hugging Face-style checkpoint in
      fp32 (embeddings, 2 decoder layers, final norm and head; 5.9 MB), with
      values that exercise rounding: random finite floats, halfway ties,
      subnormals and signed zeros.
  image_test_model.py check MODEL FETCHED LAYER
      checks that FETCHED (`layercast fetch --out`) holds exactly the tensors
      of layer LAYER (e.g. model.layers.0) of MODEL, each cast to bfloat16
      bit for bit as the default policy casts (round to nearest even).
      Exits 1 naming the first difference.
"""
import array
import json
import os
import random
import struct
import sys

HIDDEN, FFN, VOCAB = 384, 1031, 517
SHAPES = {"model.embed_tokens.weight": [VOCAB, HIDDEN]}
for _layer in range(2):
    _p = f"model.layers.{_layer}."
    SHAPES[_p + "input_layernorm.weight"] = [HIDDEN]
    SHAPES[_p + "self_attn.q_proj.weight"] = [HIDDEN, HIDDEN]
    SHAPES[_p + "mlp.up_proj.weight"] = [FFN, HIDDEN]
SHAPES["model.norm.weight"] = [HIDDEN]
SHAPES["lm_head.weight"] = [VOCAB, HIDDEN]


def read_safetensors(path):
    """(header dict, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        return header, f.read()


def tensor_bits(rng, count):
    """`count` fp32 bit patterns: finite randoms with the specials mixed in."""
    bits = array.array("I", os.urandom(4 * count))
    for i in range(count):
        u = bits[i]
        if (u >> 23) & 0xFF == 0xFF:  # no NaN or infinity
            u &= ~0x40000000
        bits[i] = u
    specials = [0x3F808000, 0x3F818000, 0xBF808000,  # ties: to even down, up, negative
                0x00000001, 0x00007FFF, 0x80008000, 0x007FFFFF,  # subnormals
                0x00000000, 0x80000000, 0x3F800000]  # zeros, one
    for value in specials:
        bits[rng.randrange(count)] = value
    return bits


def write(directory):
    rng = random.Random(20)
    header, blobs, offset = {}, [], 0
    for name in sorted(SHAPES):
        count = 1
        for d in SHAPES[name]:
            count *= d
        blob = tensor_bits(rng, count).tobytes()
        header[name] = {"dtype": "F32", "shape": SHAPES[name],
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    print(f"wrote {path}: {len(SHAPES)} tensors, {offset} bytes of fp32")


def bf16_bits(fp32):
    """fp32 bit patterns (finite) to bfloat16, round to nearest even."""
    out = array.array("H", bytes(2 * len(fp32)))
    for i, u in enumerate(fp32):
        out[i] = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return out


def check(model_path, fetched_path, layer):
    model_header, model_data = read_safetensors(model_path)
    got_header, got_data = read_safetensors(fetched_path)
    want_names = sorted(n for n in model_header if n.startswith(layer + "."))
    got_names = sorted(n for n in got_header if n != "__metadata__")
    if not want_names:
        sys.exit(f"{model_path} has no layer {layer}")
    if got_names != want_names:
        sys.exit(f"{fetched_path} holds {got_names}, but layer {layer} is {want_names}")
    elements = 0
    for name in want_names:
        want, got = model_header[name], got_header[name]
        if got["dtype"] != "BF16" or got["shape"] != want["shape"]:
            sys.exit(f"{name}: fetched {got['dtype']} {got['shape']}, expected BF16 {want['shape']}")
        begin, end = want["data_offsets"]
        source = array.array("I", model_data[begin:end])
        expected = bf16_bits(source)
        begin, end = got["data_offsets"]
        actual = array.array("H", got_data[begin:end])
        if actual != expected:
            i = next(i for i in range(len(expected)) if i >= len(actual) or actual[i] != expected[i])
            a = f"0x{actual[i]:04x}" if i < len(actual) else "nothing"
            sys.exit(f"{name}: element {i} is {a}, expected 0x{expected[i]:04x} "
                     f"(fp32 0x{source[i]:08x})")
        elements += len(expected)
    print(f"{layer}: {len(want_names)} tensors, {elements} elements, bit-exact "
          "(bfloat16, round to nearest even, from the fp32 model)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(__doc__)
