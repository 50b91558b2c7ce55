// AVX-512 F + BW kernels. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx2
// -mf16c (core/CMakeLists.txt); called only after cast.cc has seen those
// features. Tails use masked loads and stores, which never touch the
// masked-off bytes, so no scalar fallback is needed.

#include <bit>
#include <cstddef>
#include <cstdint>

#include "core/cast_error_avx512.h"
#include "core/cast_kernels.h"
#include "core/x86_intrinsics.h"

namespace layercast::internal {
namespace {

// Hardware prefetchers stop at 4 KiB page boundaries; asking for the source
// 16 KiB ahead keeps a long cast reading at memory speed (measured ~1.3x on
// 64 MiB). A prefetch never faults, so running past the end is harmless; the
// address is formed as an integer because it may lie outside the array.
void PrefetchAhead(const float* p) {
  constexpr uintptr_t kAheadBytes = 16 << 10;
  // prefetcht0. Not _mm_prefetch: GCC 12 drops it from [[gnu::flatten]]
  // functions, whose inlining leaves its hint argument a variable.
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + kAheadBytes), 0,
                     3);
}

__mmask16 FirstLanes(size_t count) {
  return count >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << count) - 1);
}

// Elements of 4 bytes from `p` to the next 64-byte boundary, at most `n`. A
// 64-byte access that straddles two cache lines costs AMD Zen 4 and 5 about
// twice an aligned one: with a source 16 bytes off a line, as malloc's
// blocks are, these kernels narrowed at half the AVX2 kernels' speed
// (11 against 23 GB/s). So each loop first works up to the boundary of the
// side it moves 64 bytes at a time on: the fp32 loads when narrowing, the
// fp32 stores when widening.
size_t ToLine(const void* p, size_t n) {
  const size_t elements = ((64 - (reinterpret_cast<uintptr_t>(p) & 63)) & 63) / 4;
  return elements < n ? elements : n;
}

// Round-to-nearest-even by integer add, as in cast_scalar.cc; the bf16 ends up
// in the high half of each lane. NaNs become the quiet NaN with their sign.
__m512i RoundToBF16High(__m512i u) {
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7F800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  const __m512i quiet = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32(0x80000000)),
                                        _mm512_set1_epi32(0x7FC00000));
  return _mm512_mask_mov_epi32(rounded, nan, quiet);
}

// 16 halves to 16 floats.
template <bool kBF16>
__m512 Lanes(__m256i half) {
  if constexpr (kBF16) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  } else {
    return _mm512_cvtph_ps(half);
  }
}

// The head up to dst's line boundary and the tail masked, full vectors
// between unmasked. (Unaligned stores all the same, at no cost once aligned:
// a float* off its 4-byte alignment, against the contract, must not fault.)
template <bool kBF16>
void Widen(const uint16_t* src, float* dst, size_t n) {
  constexpr auto kLanes = Lanes<kBF16>;
  size_t i = ToLine(dst, n);
  if (i > 0) {
    const __mmask16 valid = FirstLanes(i);
    _mm512_mask_storeu_ps(dst, valid, kLanes(_mm256_maskz_loadu_epi16(valid, src)));
  }
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i,
                     kLanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
  if (i < n) {
    const __mmask16 valid = FirstLanes(n - i);
    _mm512_mask_storeu_ps(dst + i, valid, kLanes(_mm256_maskz_loadu_epi16(valid, src + i)));
  }
}

// Calls body(add), where add(x, cast) adds what narrowing lost for 16 lanes,
// from each fp32 `x` and its cast widened back, to `*error`, by the end of
// the call; a lane whose x is +0 counts nothing, so masked-off lanes may come
// as zeros. With error->sample_every > 1, a vector whose lanes all stay in
// the normal range is measured only in the sample (avx512::MeasureLoss).
// Callers count `elements` themselves.
template <typename Body>
[[gnu::always_inline]] inline void Measuring(const NarrowingLimits& limits, CastError* error,
                                             Body&& body) {
  const __m512i overflow_floor = _mm512_set1_epi32(static_cast<int>(limits.overflow_floor));
  const __m512i below_normal = _mm512_set1_epi32(static_cast<int>(limits.normal_floor - 1));
  const __m512i normal_floor = _mm512_set1_epi32(static_cast<int>(limits.normal_floor));
  const __m512i normal_span =
      _mm512_set1_epi32(static_cast<int>(limits.overflow_floor - limits.normal_floor));
  avx512::MeasureLoss(error, [&](auto& add_loss, auto& skip) {
    auto add = [&](__m512i x, __m512 cast) __attribute__((always_inline)) {
      const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
      const __m512i one = _mm512_set1_epi32(1);
      const __m512i a = _mm512_and_si512(x, abs_mask);
      // Most vectors hold only values at or above the dtype's least normal
      // and below its overflow: each loses at most the unit roundoff, and
      // none is lost, so only a sample of them is measured. (Zero lanes are
      // below the range, so a tail takes the long way.)
      __mmask16 kept = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, normal_floor), normal_span);
      if (skip(kept)) [[likely]]
        return;
      unsigned over_count = 0, zero_count = 0, subnormal_count = 0;
      if (kept != 0xFFFF) {
        const __m512i cast_magnitude = _mm512_and_si512(_mm512_castps_si512(cast), abs_mask);
        // Finite and nonzero: a - 1 below 0x7F7FFFFF, unsigned.
        const __mmask16 finite =
            _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, one), _mm512_set1_epi32(0x7F7FFFFF));
        const __mmask16 over = _mm512_mask_cmpge_epi32_mask(finite, a, overflow_floor);
        kept = finite & ~over;
        const __mmask16 zero =
            _mm512_mask_cmpeq_epi32_mask(kept, cast_magnitude, _mm512_setzero_si512());
        const __mmask16 was_normal =
            _mm512_mask_cmpge_epi32_mask(kept, a, _mm512_set1_epi32(0x00800000));
        const __mmask16 became_subnormal = _mm512_mask_cmplt_epu32_mask(
            was_normal, _mm512_sub_epi32(cast_magnitude, one), below_normal);
        over_count = std::popcount(static_cast<unsigned>(over));
        zero_count = std::popcount(static_cast<unsigned>(zero));
        subnormal_count = std::popcount(static_cast<unsigned>(became_subnormal));
      }
      add_loss(kept, a, _mm512_sub_ps(cast, _mm512_castsi512_ps(x)), over_count, zero_count,
               subnormal_count);
    };
    body(add);
  });
}

// [[gnu::flatten]] here and on the measuring casts: every call inlines, so
// Measuring's accumulators never leave registers.
template <bool kBF16>
[[gnu::flatten]] void MeasureNarrowing(const float* src, const uint16_t* out, size_t n,
                                       const NarrowingLimits& limits, CastError* error) {
  Measuring(limits, error, [&](auto& add) {
    for (size_t i = 0; i < n; i += 16) {
      const __mmask16 valid = FirstLanes(n - i);
      add(_mm512_maskz_loadu_epi32(valid, src + i),
          Lanes<kBF16>(_mm256_maskz_loadu_epi16(valid, out + i)));
    }
  });
  error->elements += n;
}

// The bf16 in the high half of each lane, widened back, for Measuring's add.
__m512 CastOfHighHalves(__m512i rounded) {
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(0xFFFF0000)));
}

// measure(x, cast) sees every vector as it is cast (Measuring's add, or
// nothing at all).
template <typename Measure>
[[gnu::always_inline]] inline void NarrowToBF16(const float* src, uint16_t* dst, size_t n,
                                                Measure&& measure) {
  // Odd 16-bit words of the two inputs: the high halves, in order.
  alignas(64) static constexpr uint16_t kHighHalves[32] = {
      1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
      33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i high_halves = _mm512_load_si512(kHighHalves);
  auto masked = [&](size_t at, __mmask16 valid) {
    const __m512i x = _mm512_maskz_loadu_epi32(valid, src + at);
    const __m512i rounded = RoundToBF16High(x);
    measure(x, CastOfHighHalves(rounded));
    _mm512_mask_cvtepi32_storeu_epi16(dst + at, valid, _mm512_srli_epi32(rounded, 16));
  };
  size_t i = ToLine(src, n);
  if (i > 0) masked(0, FirstLanes(i));
  for (; i + 32 <= n; i += 32) {
    PrefetchAhead(src + i);
    PrefetchAhead(src + i + 16);
    const __m512i x_lo = _mm512_loadu_si512(src + i);
    const __m512i x_hi = _mm512_loadu_si512(src + i + 16);
    const __m512i lo = RoundToBF16High(x_lo);
    const __m512i hi = RoundToBF16High(x_hi);
    measure(x_lo, CastOfHighHalves(lo));
    measure(x_hi, CastOfHighHalves(hi));
    _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi16(lo, high_halves, hi));
  }
  for (; i < n; i += 16) masked(i, FirstLanes(n - i));
}

// Converts the lanes of `valid` and stores them; returns the lanes that
// overflow (kError only, and then nothing is stored or measured).
template <Fp16Overflow kOverflow, typename Measure>
[[gnu::always_inline]] inline __mmask16 F32ToF16Lanes(const float* src, uint16_t* dst,
                                                      __mmask16 valid, Measure& measure) {
  const __m512i x = _mm512_maskz_loadu_epi32(valid, src);
  const __m512i abs = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sign = _mm512_and_si512(x, _mm512_set1_epi32(0x80000000));
  const __m512i inf = _mm512_set1_epi32(0x7F800000);
  // VCVTPS2PH keeps a NaN's payload; the contract wants the plain quiet NaN.
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, inf);
  __m512i u = _mm512_mask_mov_epi32(x, nan, _mm512_or_si512(sign, _mm512_set1_epi32(0x7FC00000)));
  if constexpr (kOverflow != Fp16Overflow::kInfinity) {
    // Finite and at least 65520.0f, the first float that rounds past 65504.
    const __mmask16 big = _mm512_mask_cmplt_epi32_mask(
        _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x477FEFFF)), abs, inf);
    if constexpr (kOverflow == Fp16Overflow::kError) {
      if (big != 0) return big;
    } else {
      u = _mm512_mask_mov_epi32(u, big, _mm512_or_si512(sign, _mm512_set1_epi32(0x477FE000)));
    }
  }
  const __m256i half = _mm512_cvtps_ph(_mm512_castsi512_ps(u), _MM_FROUND_TO_NEAREST_INT);
  measure(x, _mm512_cvtph_ps(half));
  _mm256_mask_storeu_epi16(dst, valid, half);
  return 0;
}

template <Fp16Overflow kOverflow, typename Measure>
[[gnu::always_inline]] inline size_t F32ToF16(const float* src, uint16_t* dst, size_t n,
                                              Measure& measure) {
  auto lanes = [&](const float* from, uint16_t* to, __mmask16 valid) {
    return F32ToF16Lanes<kOverflow>(from, to, valid, measure);
  };
  size_t i = ToLine(src, n);
  if (i > 0) {
    const __mmask16 big = lanes(src, dst, FirstLanes(i));
    if (big != 0) return __builtin_ctz(big);
  }
  for (; i + 32 <= n; i += 32) {  // two vectors a turn, as for bf16
    PrefetchAhead(src + i);
    PrefetchAhead(src + i + 16);
    const __mmask16 big = lanes(src + i, dst + i, 0xFFFF);
    if (big != 0) return i + __builtin_ctz(big);
    const __mmask16 big2 = lanes(src + i + 16, dst + i + 16, 0xFFFF);
    if (big2 != 0) return i + 16 + __builtin_ctz(big2);
  }
  for (; i < n; i += 16) {
    const __mmask16 big = lanes(src + i, dst + i, FirstLanes(n - i));
    if (big != 0) return i + __builtin_ctz(big);
  }
  return n;
}

template <typename Measure>
[[gnu::always_inline]] inline size_t NarrowToF16(const float* src, uint16_t* dst, size_t n,
                                                 Fp16Overflow overflow, Measure&& measure) {
  switch (overflow) {
    case Fp16Overflow::kError:
      return F32ToF16<Fp16Overflow::kError>(src, dst, n, measure);
    case Fp16Overflow::kSaturate:
      return F32ToF16<Fp16Overflow::kSaturate>(src, dst, n, measure);
    case Fp16Overflow::kInfinity:
      break;
  }
  return F32ToF16<Fp16Overflow::kInfinity>(src, dst, n, measure);
}

}  // namespace

void F32ToBF16Avx512(const float* src, uint16_t* dst, size_t n) {
  NarrowToBF16(src, dst, n, [](__m512i, __m512) {});
}

size_t F32ToF16Avx512(const float* src, uint16_t* dst, size_t n, Fp16Overflow overflow) {
  return NarrowToF16(src, dst, n, overflow, [](__m512i, __m512) {});
}

[[gnu::flatten]] void F32ToBF16MeasuredAvx512(const float* src, uint16_t* dst, size_t n,
                                              const NarrowingLimits& limits, CastError* error) {
  Measuring(limits, error, [&](auto& add) { NarrowToBF16(src, dst, n, add); });
  error->elements += n;
}

[[gnu::flatten]] size_t F32ToF16MeasuredAvx512(const float* src, uint16_t* dst, size_t n,
                                               Fp16Overflow overflow, const NarrowingLimits& limits,
                                               CastError* error) {
  size_t done = 0;
  Measuring(limits, error, [&](auto& add) { done = NarrowToF16(src, dst, n, overflow, add); });
  error->elements += done;
  return done;
}

void MeasureNarrowingAvx512(const float* src, const uint16_t* out, size_t n,
                            const NarrowingLimits& limits, CastError* error) {
  if (limits.bf16) {
    MeasureNarrowing<true>(src, out, n, limits, error);
  } else {
    MeasureNarrowing<false>(src, out, n, limits, error);
  }
}

void BF16ToF32Avx512(const uint16_t* src, float* dst, size_t n) { Widen<true>(src, dst, n); }

void F16ToF32Avx512(const uint16_t* src, float* dst, size_t n) { Widen<false>(src, dst, n); }

}  // namespace layercast::internal
