#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/cast.h"
#include "core/cast_error.h"

// Per-instruction-set kernels behind core/cast.h. cast.cc picks one at run
// time; callers outside core/ use cast.h instead.
//
// Every kernel of a family gives identical bits (the contract in cast.h). The
// AVX2 and AVX-512 kernels live in files compiled with those instruction sets
// enabled, so they may only be called once the CPU is known to have them, and
// those files must not define inline functions or templates that other files
// also instantiate: the linker could keep the AVX copy for everyone.
//
// REQUIRES for all: `src` and `dst` do not overlap and are aligned to their
// element type (no stronger alignment is needed); `n` may be anything,
// including 0.

namespace layercast::internal {

// Dispatch: a CPU as CPUID leaves 0 and 1 name it, display family and
// model as the vendors compose them.
struct CpuModel {
  std::string vendor = {};  // "GenuineIntel", "AuthenticAMD"; empty if unknown
  unsigned family = 0;
  unsigned model = 0;
};
// The selection for `cpu`, which runs the variants `runs` (as
// SupportedCastIsas lists them): its table row's preference for each cast,
// or the widest narrower variant it runs; the widest it runs where no row
// names the CPU. A pure function: one kind of machine, one choice.
CastIsaSelection SelectFor(const CpuModel& cpu, const std::vector<CastIsa>& runs);

void F32ToBF16Scalar(const float* src, uint16_t* dst, size_t n);
void F32ToBF16Avx2(const float* src, uint16_t* dst, size_t n);
void F32ToBF16Avx512(const float* src, uint16_t* dst, size_t n);
// AVX-512 BF16's conversion instruction, with the AVX-512 kernel for blocks
// holding subnormals or NaNs (the instruction flushes the one and keeps the
// other's payload).
void F32ToBF16Avx512Bf16(const float* src, uint16_t* dst, size_t n);

// Returns n, or with Fp16Overflow::kError the index of the first finite
// element that rounds beyond 65504; elements from some point before that index
// on are then left unwritten.
size_t F32ToF16Scalar(const float* src, uint16_t* dst, size_t n, Fp16Overflow overflow);
size_t F32ToF16Avx2(const float* src, uint16_t* dst, size_t n, Fp16Overflow overflow);
size_t F32ToF16Avx512(const float* src, uint16_t* dst, size_t n, Fp16Overflow overflow);

void BF16ToF32Scalar(const uint16_t* src, float* dst, size_t n);
void BF16ToF32Avx2(const uint16_t* src, float* dst, size_t n);
void BF16ToF32Avx512(const uint16_t* src, float* dst, size_t n);

void F16ToF32Scalar(const uint16_t* src, float* dst, size_t n);
void F16ToF32Avx2(const uint16_t* src, float* dst, size_t n);
void F16ToF32Avx512(const uint16_t* src, float* dst, size_t n);

// 65520.0f: the smallest magnitude that rounds beyond float16's 65504 (a tie
// between 65504, odd, and infinity).
constexpr uint32_t kF16OverflowFloor = 0x477FF000;
// 2^-14: the smallest magnitude whose float16 is normal.
constexpr uint32_t kF16NormalFloor = 0x38800000;
// 0x1.FFp127: the tie between bfloat16's largest finite (0x7F7F, odd) and
// infinity, the smallest magnitude that rounds beyond it.
constexpr uint32_t kBF16OverflowFloor = 0x7F7F8000;
// 2^-126: the smallest normal fp32 (and bfloat16).
constexpr uint32_t kF32NormalFloor = 0x00800000;

// What narrowing to a 16-bit dtype lost (core/cast_error.h), added into
// *error. `out` holds the cast of `src`.
struct NarrowingLimits {
  bool bf16;                // else float16
  uint32_t overflow_floor;  // fp32 bits of the least magnitude that rounds past the largest finite
  uint32_t normal_floor;    // fp32 bits of the dtype's least normal magnitude
};
constexpr NarrowingLimits kBF16Limits = {
    .bf16 = true, .overflow_floor = kBF16OverflowFloor, .normal_floor = kF32NormalFloor};
constexpr NarrowingLimits kF16Limits = {
    .bf16 = false, .overflow_floor = kF16OverflowFloor, .normal_floor = kF16NormalFloor};
// The vector kernels bucket a relative error by table instead of a compare
// per bound. Every bound is a power of two 2^-k, so an r >= 0 with fp32 bits
// R exceeds it exactly when (R - 1) >> 23 (arithmetic: -1 for r = 0) is at
// least 127 - k. Less kBucketIndexBias, that is a bucket index from 0 to 23
// for r in (2^-24, 1], and negative at or below 2^-24, which an unsigned
// clamp to kBucketIndexBelow maps to no bucket.
constexpr int kBucketIndexBias = 127 - 24;
constexpr int kBucketIndexBelow = 31;
// How many of CastError::kBounds an error with bucket index `index` exceeds
// (they ascend, so it exceeds the first that many).
constexpr int BoundsExceeded(int index) {
  if (index == kBucketIndexBelow) return 0;
  int exceeded = 0;
  for (float bound : CastError::kBounds) {
    exceeded += index + kBucketIndexBias >= static_cast<int>(std::bit_cast<uint32_t>(bound) >> 23);
  }
  return exceeded;
}
static_assert(std::bit_cast<uint32_t>(CastError::kBounds[0]) >> 23 == kBucketIndexBias);

// Narrowing and measuring in one pass, as CastFromF32 with a CastError*
// runs them where the CPU has AVX-512: the cast's bits, and what
// MeasureNarrowing* adds for them, with each element measured (or, outside
// error->sample_every's sample, tested) from the registers it was cast in,
// so nothing is read twice.
// F32ToF16MeasuredAvx512 returns as F32ToF16Avx512 does; after an overflow
// under kError, `*error` holds an unspecified part of the measurement.
void F32ToBF16MeasuredAvx512(const float* src, uint16_t* dst, size_t n,
                             const NarrowingLimits& limits, CastError* error);
size_t F32ToF16MeasuredAvx512(const float* src, uint16_t* dst, size_t n, Fp16Overflow overflow,
                              const NarrowingLimits& limits, CastError* error);

void MeasureNarrowingScalar(const float* src, const uint16_t* out, size_t n,
                            const NarrowingLimits& limits, CastError* error);
void MeasureNarrowingAvx2(const float* src, const uint16_t* out, size_t n,
                          const NarrowingLimits& limits, CastError* error);
void MeasureNarrowingAvx512(const float* src, const uint16_t* out, size_t n,
                            const NarrowingLimits& limits, CastError* error);

}  // namespace layercast::internal
