#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/strings/string_view.h"
#include "core/cast.h"

namespace layercast {

struct CastError;  // core/cast_error.h

// The two 8-bit floating-point formats of the OCP 8-bit Floating Point
// Specification (OFP8, rev. 1.0), with one fp32 scale per block of elements.
//
// Formats (sign, exponent and mantissa bits; bias):
// - kE4M3FN: 1.4.3, bias 7. No infinities; S.1111.111 is NaN (0x7F, 0xFF);
//   largest finite 448 (S.1111.110), smallest normal 2^-6, smallest
//   subnormal 2^-9.
// - kE5M2: 1.5.2, bias 15. S.11111.00 is infinity, S.11111.{01,10,11} NaN;
//   largest finite 57344 (S.11110.11), smallest normal 2^-14, smallest
//   subnormal 2^-16.
//
// Quantizing a block x[0..k) (the exact semantics the kernels and the tests'
// independent reference share):
// - amax = the largest |x[i]| over the block's finite elements (0 if none);
// - the block's scale s = fl32(amax / max_finite), raised to 2^-126 (fp32's
//   least normal) when smaller, and 1 when amax is 0: never subnormal, since
//   GPU kernels commonly flush subnormal operands to zero;
// - y[i] = fl32(x[i] / s), an IEEE fp32 division rounded to nearest even;
// - q[i] = y[i] rounded to the nearest value of the format, ties to the even
//   code (mantissa's last bit 0), subnormals kept; a |y[i]| beyond the
//   largest finite value (only +-inf, or fl32 rounding of the quotient)
//   saturates to +-max_finite, in both formats (kE5M2's infinity is never
//   produced); NaN gives the format's NaN with x's sign (kE4M3FN 0x7F,
//   kE5M2 0x7E, or'ed with 0x80 for a negative sign).
// Dequantizing: x'[i] = fl32(value(q[i]) * s); value() is exact in fp32.
//
// A tensor's blocks start at its element 0 and hold block_size elements
// each (the last may be shorter), so a shard's slice must start on a block
// boundary to quantize its blocks alone.
enum class Fp8Format : uint8_t { kE4M3FN, kE5M2 };

// The format of an 8-bit DType. REQUIRES: IsFloat8(dtype).
Fp8Format Fp8FormatOf(DType dtype);

// "float8_e4m3fn", "float8_e5m2" (PyTorch's names).
absl::string_view Fp8FormatName(Fp8Format format);
// 448 or 57344.
float Fp8MaxFinite(Fp8Format format);
// The code's value, exactly; NaN codes give a quiet NaN with the code's sign,
// kE5M2's infinities +-inf.
float Fp8ToF32(uint8_t code, Fp8Format format);

// The scale of one block, as defined above.
float Fp8BlockScale(std::span<const float> block, Fp8Format format);

// Quantizes every element of `src` with the one scale `scale` (a normal,
// positive fp32) into `dst` (same length). The kernel the others are built
// on, exposed for the tests and benchmarks.
void QuantizeFp8WithScale(std::span<const float> src, float scale, Fp8Format format,
                          std::span<uint8_t> dst);
// With `isa`'s kernel: kAvx512 and kAvx512Bf16 run the AVX-512 kernel, kAvx2
// the AVX2 one, kScalar (and a variant this CPU lacks) the scalar one. Same
// bits.
void QuantizeFp8WithScale(std::span<const float> src, float scale, Fp8Format format,
                          std::span<uint8_t> dst, CastIsa isa);

// Blocks of `src`, as a tensor's from its element 0: ceil(n / block_size).
inline size_t Fp8BlockCount(size_t elements, size_t block_size) {
  return (elements + block_size - 1) / block_size;
}

// Quantizes `src` block by block (block_size > 0): dst.size() == src.size(),
// scales.size() == Fp8BlockCount(src.size(), block_size). With `error`, also
// adds what it lost (core/cast_error.h; each block measured right after it is
// quantized, while it is in L1).
void QuantizeFp8(std::span<const float> src, size_t block_size, Fp8Format format,
                 std::span<uint8_t> dst, std::span<float> scales, CastError* error = nullptr);
void QuantizeFp8(std::span<const float> src, size_t block_size, Fp8Format format,
                 std::span<uint8_t> dst, std::span<float> scales, CastError* error, CastIsa isa);

// The inverse: dst[i] = fl32(value(src[i]) * scales[i / block_size]).
void DequantizeFp8(std::span<const uint8_t> src, size_t block_size, std::span<const float> scales,
                   Fp8Format format, std::span<float> dst);

// Adds what quantizing `src` (with one scale `scale`) into `q` lost to
// `*error`, with CastError's definitions, where the cast c = fl32(value(q) *
// scale) and its relative error |fl32(c - x)| / |x| is an fp32 quotient;
// overflowed counts finite x whose quotient fl32(x / scale) saturated
// (beyond 464 for kE4M3FN, at or beyond 61440 for kE5M2: where saturating
// changed the result), which the block scale prevents. The
// widest kernel this CPU runs (AVX-512's sums the errors in fp32 lanes per
// call before adding them up in double: the sum differs from the scalar
// kernel's in its last digits, the counts and the maximum do not).
void MeasureFp8Error(std::span<const float> src, std::span<const uint8_t> q, float scale,
                     Fp8Format format, CastError* error);

}  // namespace layercast
