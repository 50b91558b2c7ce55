// AVX2 + F16C kernels. Compiled with -mavx2 -mf16c -mfma (core/CMakeLists.txt);
// called only after cast.cc has seen those features. Tails shorter than a
// vector go to the scalar kernels, which give the same bits.

#include <immintrin.h>

#include <array>
#include <cstddef>
#include <cstdint>

#include "core/cast_kernels.h"

namespace layercast::internal {
namespace {

// Hardware prefetchers stop at 4 KiB page boundaries; asking for the source
// 16 KiB ahead keeps a long cast reading at memory speed (measured ~1.3x on
// 64 MiB). A prefetch never faults, so running past the end is harmless; the
// address is formed as an integer because it may lie outside the array.
void PrefetchAhead(const float* p) {
  constexpr uintptr_t kAheadBytes = 16 << 10;
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kAheadBytes),
               _MM_HINT_T0);
}

// Round-to-nearest-even by integer add, as in cast_scalar.cc; leaves the bf16
// in the low half of each lane. NaNs become the quiet NaN with their sign.
__m256i RoundToBF16(__m256i u) {
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32(0x80000000)),
                                        _mm256_set1_epi32(0x7FC00000));
  rounded = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm256_srli_epi32(rounded, 16);
}

// Returns n, or with kError the index of the first overflowing element.
template <Fp16Overflow kOverflow>
size_t F32ToF16(const float* src, uint16_t* dst, size_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i sign_mask = _mm256_set1_epi32(0x80000000);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    PrefetchAhead(src + i);
    __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    const __m256i abs = _mm256_and_si256(u, abs_mask);
    const __m256i sign = _mm256_and_si256(u, sign_mask);
    // VCVTPS2PH keeps a NaN's payload; the contract wants the plain quiet NaN.
    const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F800000));
    u = _mm256_blendv_epi8(u, _mm256_or_si256(sign, _mm256_set1_epi32(0x7FC00000)), nan);
    if constexpr (kOverflow != Fp16Overflow::kInfinity) {
      // Finite and at least 65520.0f, the first float that rounds past 65504.
      const __m256i big =
          _mm256_andnot_si256(_mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F7FFFFF)),
                              _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x477FEFFF)));
      if constexpr (kOverflow == Fp16Overflow::kError) {
        if (!_mm256_testz_si256(big, big)) {
          return i + __builtin_ctz(_mm256_movemask_ps(_mm256_castsi256_ps(big)));
        }
      } else {
        u = _mm256_blendv_epi8(u, _mm256_or_si256(sign, _mm256_set1_epi32(0x477FE000)), big);
      }
    }
    const __m128i half = _mm256_cvtps_ph(_mm256_castsi256_ps(u), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), half);
  }
  return i + F32ToF16Scalar(src + i, dst + i, n - i, kOverflow);
}

int64_t Sum(__m256i lanes) {
  alignas(32) int32_t values[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(values), lanes);
  int64_t sum = 0;
  for (int32_t v : values) sum += v;
  return sum;
}

// As in cast_avx512.cc: counts in 32-bit lanes and sums in fp32 lanes,
// flushed into `error` every kSumBlock elements (512 terms a lane here: the
// sum within about 2^-15 of exact). Compares yield -1 per lane,
// so counting subtracts them. The tail goes to the scalar kernel.
constexpr size_t kSumBlock = 4096;

// Buckets by table, as in cast_avx512.cc, with PSHUFB's 16 entries: every
// bound's bucket index (cast_kernels.h) is even, so half the index selects
// the entry, which is how far to shift ones right to leave one bit in each
// exceeded bound's 4-bit field. The fields are added into 32-bit counts
// every 15 vectors, before they can overflow.
constexpr int kNibbleFlush = 15;

constexpr std::array<uint8_t, 16> ShiftTable() {
  std::array<uint8_t, 16> table{};
  for (int half = 0; half < 16; ++half) {
    table[half] =
        static_cast<uint8_t>(32 - 4 * BoundsExceeded(half == 15 ? kBucketIndexBelow : 2 * half));
  }
  return table;
}
constexpr std::array<uint8_t, 16> kShiftTable = ShiftTable();
static_assert(kBucketIndexBelow / 2 == 15);
static_assert([] {
  for (int index = 0; index < 24; ++index) {
    if (BoundsExceeded(index) != BoundsExceeded(index & ~1)) return false;
  }
  return true;
}());

template <bool kBF16>
void MeasureNarrowing(const float* src, const uint16_t* out, size_t n,
                      const NarrowingLimits& limits, CastError* error) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i overflow_below = _mm256_set1_epi32(static_cast<int>(limits.overflow_floor - 1));
  const __m256i normal_floor = _mm256_set1_epi32(static_cast<int>(limits.normal_floor));
  const __m256i below_normal = _mm256_set1_epi32(static_cast<int>(limits.normal_floor - 1));
  const __m256i overflow_floor = _mm256_set1_epi32(static_cast<int>(limits.overflow_floor));
  const __m256i shifts = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kShiftTable.data())));
  const __m256i index_offset = _mm256_set1_epi32(-1 - (kBucketIndexBias << 23));
  const __m256i below = _mm256_set1_epi32(kBucketIndexBelow);
  const __m256i low_byte = _mm256_set1_epi32(0xFF);
  const __m256i field_ones = _mm256_set1_epi32(0x11111111);
  const __m256i all_ones = _mm256_set1_epi32(-1);
  const __m256i nibble = _mm256_set1_epi32(0xF);
  const size_t vectors_end = n - n % 8;
  for (size_t begin = 0; begin < vectors_end; begin += kSumBlock) {
    const size_t end = vectors_end - begin < kSumBlock ? vectors_end : begin + kSumBlock;
    __m256i overflowed = zero, flushed = zero, subnormal = zero, measured = zero, nibbles = zero;
    __m256i above[CastError::kBuckets];
    for (__m256i& count : above) count = zero;
    auto flush_nibbles = [&] {
      for (int j = 0; j < CastError::kBuckets; ++j) {
        above[j] =
            _mm256_add_epi32(above[j], _mm256_and_si256(_mm256_srli_epi32(nibbles, 4 * j), nibble));
      }
      nibbles = zero;
    };
    __m256 sum = _mm256_setzero_ps(), max = sum;
    int pending = 0;
    for (size_t i = begin; i < end; i += 8) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(out + i));
      __m256 cast;
      if constexpr (kBF16) {
        cast = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
      } else {
        cast = _mm256_cvtph_ps(half);
      }
      const __m256i a = _mm256_and_si256(x, abs_mask);
      const __m256 magnitude = _mm256_castsi256_ps(a);
      const __m256 difference =
          _mm256_and_ps(_mm256_sub_ps(cast, _mm256_castsi256_ps(x)), _mm256_castsi256_ps(abs_mask));
      __m256 relative;
      // Most vectors hold only values at or above the dtype's least normal
      // and below its overflow: each is measured and none lost.
      const __m256i in_range = _mm256_and_si256(_mm256_cmpgt_epi32(a, below_normal),
                                                _mm256_cmpgt_epi32(overflow_floor, a));
      if (_mm256_movemask_ps(_mm256_castsi256_ps(in_range)) == 0xFF) {
        measured = _mm256_sub_epi32(measured, in_range);
        relative = _mm256_div_ps(difference, magnitude);
      } else {
        const __m256i cast_magnitude = _mm256_and_si256(_mm256_castps_si256(cast), abs_mask);
        const __m256i finite = _mm256_and_si256(
            _mm256_cmpgt_epi32(a, zero), _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), a));
        const __m256i over = _mm256_and_si256(finite, _mm256_cmpgt_epi32(a, overflow_below));
        const __m256i kept = _mm256_andnot_si256(over, finite);
        const __m256i flush = _mm256_and_si256(kept, _mm256_cmpeq_epi32(cast_magnitude, zero));
        const __m256i was_normal =
            _mm256_and_si256(kept, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x007FFFFF)));
        const __m256i became_subnormal = _mm256_and_si256(
            was_normal, _mm256_and_si256(_mm256_cmpgt_epi32(cast_magnitude, zero),
                                         _mm256_cmpgt_epi32(normal_floor, cast_magnitude)));
        overflowed = _mm256_sub_epi32(overflowed, over);
        flushed = _mm256_sub_epi32(flushed, flush);
        subnormal = _mm256_sub_epi32(subnormal, became_subnormal);
        measured = _mm256_sub_epi32(measured, kept);
        // Lanes not kept divide by 1 and are then zeroed.
        const __m256 divisor =
            _mm256_blendv_ps(_mm256_set1_ps(1.0f), magnitude, _mm256_castsi256_ps(kept));
        relative = _mm256_and_ps(_mm256_div_ps(difference, divisor), _mm256_castsi256_ps(kept));
      }
      const __m256i index = _mm256_min_epu32(
          _mm256_srai_epi32(_mm256_add_epi32(_mm256_castps_si256(relative), index_offset), 23),
          below);
      // Bytes above the first of each lane look up entry 0; masked off.
      const __m256i shift =
          _mm256_and_si256(_mm256_shuffle_epi8(shifts, _mm256_srli_epi32(index, 1)), low_byte);
      nibbles = _mm256_add_epi32(nibbles,
                                 _mm256_and_si256(_mm256_srlv_epi32(all_ones, shift), field_ones));
      if (++pending == kNibbleFlush) {
        flush_nibbles();
        pending = 0;
      }
      sum = _mm256_add_ps(sum, relative);
      max = _mm256_max_ps(max, relative);
    }
    flush_nibbles();
    error->elements += end - begin;
    error->overflowed += Sum(overflowed);
    error->flushed_to_zero += Sum(flushed);
    error->became_subnormal += Sum(subnormal);
    error->measured += Sum(measured);
    for (int k = 0; k < CastError::kBuckets; ++k) error->above[k] += Sum(above[k]);
    alignas(32) float sums[8], maxima[8];
    _mm256_store_ps(sums, sum);
    _mm256_store_ps(maxima, max);
    for (int lane = 0; lane < 8; ++lane) {
      error->relative_error_sum += sums[lane];
      if (maxima[lane] > error->max_relative_error) error->max_relative_error = maxima[lane];
    }
  }
  MeasureNarrowingScalar(src + vectors_end, out + vectors_end, n - vectors_end, limits, error);
}

}  // namespace

void MeasureNarrowingAvx2(const float* src, const uint16_t* out, size_t n,
                          const NarrowingLimits& limits, CastError* error) {
  if (limits.bf16) {
    MeasureNarrowing<true>(src, out, n, limits, error);
  } else {
    MeasureNarrowing<false>(src, out, n, limits, error);
  }
}

void F32ToBF16Avx2(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    PrefetchAhead(src + i);
    const __m256i lo = RoundToBF16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m256i hi =
        RoundToBF16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8)));
    // packus works per 128-bit lane, giving lo0-3 hi0-3 lo4-7 hi4-7.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  F32ToBF16Scalar(src + i, dst + i, n - i);
}

size_t F32ToF16Avx2(const float* src, uint16_t* dst, size_t n, Fp16Overflow overflow) {
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

void BF16ToF32Avx2(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_slli_epi32(wide, 16));
  }
  BF16ToF32Scalar(src + i, dst + i, n - i);
}

void F16ToF32Avx2(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  F16ToF32Scalar(src + i, dst + i, n - i);
}

}  // namespace layercast::internal
