"""Checks layercast's fp32 -> bf16/fp16 bits against PyTorch's.

Usage: cast_torch_test.py FILE, where FILE is what tests/core/cast_torch_test.cc
writes: u64 count, u64 variants, f32 inputs[count], then per variant
u16 bf16[count] and u16 f16[count], all little-endian. For non-NaN inputs the
bits must equal `x.to(torch.bfloat16)` / `x.to(torch.float16)`; for NaN inputs
they must be the quiet NaN with the input's sign (bf16 0x7FC0, fp16 0x7E00).
Exits 1 and lists the first mismatches if any.
"""

import struct
import sys

import torch


def check(name, x, got, want, quiet_nan):
    nan = torch.isnan(x)
    sign = torch.signbit(x).to(torch.int32) << 15
    want = torch.where(nan, sign | quiet_nan, want.to(torch.int32) & 0xFFFF)
    bad = (got.to(torch.int32) & 0xFFFF) != want
    for i in bad.nonzero().flatten()[:10].tolist():
        bits = struct.unpack("<I", struct.pack("<f", x[i].item()))[0]
        print(f"{name}: fp32 0x{bits:08x} gave 0x{int(got[i]) & 0xFFFF:04x}, "
              f"want 0x{int(want[i]):04x}")
    return int(bad.sum())


def main(path):
    data = bytearray(open(path, "rb").read())
    count, variants = struct.unpack_from("<QQ", data)
    offset = 16
    x = torch.frombuffer(data, dtype=torch.float32, count=count, offset=offset)
    offset += 4 * count
    want_bf16 = x.to(torch.bfloat16).view(torch.int16)
    want_f16 = x.to(torch.float16).view(torch.int16)
    mismatches = 0
    for variant in range(variants):
        for name, want, quiet_nan in (("bf16", want_bf16, 0x7FC0), ("f16", want_f16, 0x7E00)):
            got = torch.frombuffer(data, dtype=torch.int16, count=count, offset=offset)
            offset += 2 * count
            mismatches += check(f"variant {variant} {name}", x, got, want, quiet_nan)
    print(f"torch {torch.__version__}: {count} values x {variants} variants, "
          f"bf16 and f16: {mismatches} mismatches")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
