#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/cast.h"
#include "core/dtype.h"

namespace layercast {

// What a narrowing cast lost, measured while it casts (CastFromF32 with a
// CastError*), so an operator sees it instead of guessing.
//
// For an fp32 x and its cast c (widened back to fp32, exactly):
// - overflowed: x finite, |x| at or beyond the first value that rounds past
//   the dtype's largest finite value (bf16: 0x1.FFp127; f16: 65520), so c is
//   +-inf or, with Fp16Overflow::kSaturate, +-65504;
// - flushed_to_zero: x finite and nonzero, c = +-0;
// - became_subnormal: x a normal fp32, c a subnormal of the dtype;
// - measured: x finite, nonzero and not overflowed: the population of the
//   relative error |c - x| / |x|, computed as the fp32 quotient of exact
//   operands (c - x is exact: c is x rounded), so it is at most 1 (flushed).
// NaNs and infinities count only in `elements`.
//
// Sampling (sample_every > 1, the AVX-512 kernels; the others measure every
// element): a round-to-nearest cast whose result is a normal value of the
// dtype loses at most half an ulp, a relative error of at most the dtype's
// unit roundoff (RelativeErrorBound), so only the elements outside that
// range (overflowed, saturated, flushed, subnormal) can lose more, and those
// are rare. Every vector holding one is measured, so the counts above and a
// maximum beyond the bound are exact (a policy's max_rel_error at or above
// the bound gates exactly); of the vectors whose every element stays normal,
// one in sample_every is measured and the others counted `unmeasured`, so
// `measured`, the buckets, the sum and a maximum within the bound describe
// a deterministic sample.
struct CastError {
  // Bounds of the relative-error buckets. bf16 rounds a normal value within
  // 2^-8 of itself, f16 within 2^-11: each dtype fills a bucket of its own,
  // and anything above 2^-8 has lost most of its precision (subnormal).
  static constexpr int kBuckets = 8;
  static constexpr std::array<float, kBuckets> kBounds = {0x1p-24f, 0x1p-16f, 0x1p-12f, 0x1p-10f,
                                                          0x1p-8f,  0x1p-6f,  0x1p-4f,  0x1p-2f};

  // Set by the caller before a measured cast: measure one in this many of
  // the vectors that stay in the normal range (1: every one). Not added up.
  uint32_t sample_every = 1;

  uint64_t elements = 0;
  // Finite, nonzero elements whose cast is normal, outside the sample.
  uint64_t unmeasured = 0;
  uint64_t overflowed = 0;
  uint64_t flushed_to_zero = 0;
  uint64_t became_subnormal = 0;
  uint64_t measured = 0;
  // Measured elements whose relative error exceeds kBounds[k] (so
  // measured - above[k] is Prometheus' cumulative "le" bucket).
  std::array<uint64_t, kBuckets> above{};
  // In the order the kernel added them, each vector lane in fp32 over 4096
  // elements at a time: kernels of different instruction sets agree to about
  // 1e-5 relative, not bit for bit.
  double relative_error_sum = 0;
  float max_relative_error = 0;

  void Add(const CastError& other);
  // Whether this loses more than a policy's max_rel_error=`bound` allows: an
  // element with a larger relative error, or one that overflowed (to
  // infinity, or saturated), whatever the bound.
  bool Exceeds(float bound) const { return overflowed > 0 || max_relative_error > bound; }
  double MeanRelativeError() const;
  // Whether the figures of the measured elements describe a sample.
  bool sampled() const { return unmeasured > 0; }
  // "1048576 elements: max relative error 0.00195, mean 0.000488; 3 flushed to
  // zero, 0 overflowed, 0 became subnormal".
  std::string Describe() const;
};

// Adds what narrowing `n` fp32 values at `src` to `to` (kBFloat16 or
// kFloat16) into `out` lost to `*error`. `out` must hold the cast of `src`.
// CastFromF32 calls this piece by piece while the piece is in L1, so the data
// crosses the memory bus once; it is exposed for tests and benchmarks.
// Runs the widest kernel this CPU has (the work is in L1, so wider is faster).
void MeasureCastError(const float* src, const uint16_t* out, size_t n, DType to, CastError* error);
// With `isa`'s kernel (kAvx512Bf16 runs kAvx512's; one this CPU lacks runs
// kScalar's). Counts and the maximum are identical for every variant.
void MeasureCastError(const float* src, const uint16_t* out, size_t n, DType to, CastError* error,
                      CastIsa isa);

// The most a round-to-nearest cast to `dtype` (bfloat16, float16 or an
// 8-bit float) loses, relative, where its result is a normal value: the
// dtype's unit roundoff, 2^-(mantissa bits + 1).
float RelativeErrorBound(DType dtype);

}  // namespace layercast
