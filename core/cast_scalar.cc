// The portable kernels, and the reference the vector kernels must match bit
// for bit. The casts use integer arithmetic only, so their results do not
// depend on the floating-point environment (rounding mode, flush-to-zero,
// denormals-are-zero); the cast-error measurement divides in fp32, as the
// vector kernels do, under the default environment.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/cast_kernels.h"

namespace layercast::internal {
namespace {

// F32ToBF16Scalar works in chunks of this many: a fixed-length, branch-free
// inner loop, which the compiler vectorizes with the baseline instruction set
// (SSE2 on x86-64) even at -O2.
constexpr size_t kChunk = 16;
constexpr uint32_t kAbsMask = 0x7FFFFFFF;
constexpr uint32_t kF32Inf = 0x7F800000;

uint16_t F32ToBF16(uint32_t u) {
  // Adding just under half an ulp, plus the lsb that survives, rounds to
  // nearest even; a carry out of the mantissa bumps the exponent, which is the
  // right answer up to and including rounding to infinity.
  const uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  const uint32_t quiet_nan = ((u >> 16) & 0x8000) | 0x7FC0;
  return static_cast<uint16_t>((u & kAbsMask) > kF32Inf ? quiet_nan : rounded);
}

// `a` is a finite magnitude below kF16NormalFloor: the float16 is subnormal or
// zero, a count of units of 2^-24. As a = mantissa * 2^(exponent - 150), the
// count is mantissa >> (126 - exponent), rounded as in F32ToBF16.
uint32_t RoundToF16Subnormal(uint32_t a) {
  const uint32_t exponent = a >> 23;
  if (exponent < 102) return 0;  // below 2^-25, half the smallest subnormal
  const uint32_t mantissa = (a & 0x7FFFFF) | 0x800000;
  const uint32_t shift = 126 - exponent;  // 14..24
  // A carry into bit 10 gives 0x400, the smallest normal: right.
  return (mantissa + (1u << (shift - 1)) - 1 + ((mantissa >> shift) & 1)) >> shift;
}

// Branches, unlike F32ToBF16: SSE2 has neither unsigned compares nor per-lane
// shifts, and its compiler-vectorized form measured slower than this loop.
template <Fp16Overflow kOverflow>
size_t F32ToF16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(src[i]);
    const uint32_t a = u & kAbsMask;
    uint32_t magnitude;
    if (a >= kF16NormalFloor && a < kF16OverflowFloor) {  // the common case first
      const uint32_t rebiased = a - (112u << 23);         // exponent bias 127 -> 15
      magnitude = (rebiased + 0xFFF + ((rebiased >> 13) & 1)) >> 13;
    } else if (a < kF16NormalFloor) {
      magnitude = RoundToF16Subnormal(a);
    } else if (a >= kF32Inf) {
      magnitude = a == kF32Inf ? 0x7C00 : 0x7E00;
    } else if constexpr (kOverflow == Fp16Overflow::kError) {
      return i;
    } else {
      magnitude = kOverflow == Fp16Overflow::kSaturate ? 0x7BFF : 0x7C00;
    }
    dst[i] = static_cast<uint16_t>(((u >> 16) & 0x8000) | magnitude);
  }
  return n;
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = (h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    // As VCVTPH2PS does: a signalling NaN comes back quiet.
    bits = kF32Inf | (mantissa << 13) | (mantissa != 0 ? 0x400000 : 0);
  } else if (exponent != 0) {
    bits = ((exponent + 112) << 23) | (mantissa << 13);
  } else {
    // Zero or subnormal: mantissa * 2^-24 is exact in fp32 and normal there
    // (or zero), so flush-to-zero settings cannot touch it.
    bits = std::bit_cast<uint32_t>(static_cast<float>(mantissa) * 0x1p-24f);
  }
  return std::bit_cast<float>(sign | bits);
}

}  // namespace

void F32ToBF16Scalar(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    for (size_t j = 0; j < kChunk; ++j) {
      dst[i + j] = F32ToBF16(std::bit_cast<uint32_t>(src[i + j]));
    }
  }
  for (; i < n; ++i) dst[i] = F32ToBF16(std::bit_cast<uint32_t>(src[i]));
}

size_t F32ToF16Scalar(const float* src, uint16_t* dst, size_t n, Fp16Overflow overflow) {
  switch (overflow) {
    case Fp16Overflow::kError:
      return F32ToF16<Fp16Overflow::kError>(src, dst, n);
    case Fp16Overflow::kSaturate:
      return F32ToF16<Fp16Overflow::kSaturate>(src, dst, n);
    case Fp16Overflow::kInfinity:
      break;
  }
  return F32ToF16<Fp16Overflow::kInfinity>(src, dst, n);
}

void BF16ToF32Scalar(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(uint32_t{src[i]} << 16);
}

void F16ToF32Scalar(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F16ToF32(src[i]);
}

void MeasureNarrowingScalar(const float* src, const uint16_t* out, size_t n,
                            const NarrowingLimits& limits, CastError* error) {
  error->elements += n;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t a = std::bit_cast<uint32_t>(src[i]) & kAbsMask;
    if (a - 1 >= kF32Inf - 1) continue;  // zero, infinity or NaN
    if (a >= limits.overflow_floor) {
      ++error->overflowed;
      continue;
    }
    const float cast =
        limits.bf16 ? std::bit_cast<float>(uint32_t{out[i]} << 16) : F16ToF32(out[i]);
    const uint32_t cast_magnitude = std::bit_cast<uint32_t>(cast) & kAbsMask;
    if (cast_magnitude == 0) {
      ++error->flushed_to_zero;
    } else if (cast_magnitude < limits.normal_floor && a >= kF32NormalFloor) {
      ++error->became_subnormal;
    }
    ++error->measured;
    // Exact operands (cast - x is exact, cast being x rounded): the quotient
    // is the one rounding, as in the vector kernels.
    const float relative = std::fabs(cast - src[i]) / std::bit_cast<float>(a);
    for (int k = 0; k < CastError::kBuckets && relative > CastError::kBounds[k]; ++k) {
      ++error->above[k];
    }
    error->relative_error_sum += relative;
    error->max_relative_error = std::max(error->max_relative_error, relative);
  }
}

}  // namespace layercast::internal
