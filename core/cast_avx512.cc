// AVX-512 F + BW kernels. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx2
// -mf16c (core/CMakeLists.txt); called only after cast.cc has seen those
// features. Tails use masked loads and stores, which never touch the
// masked-off bytes, so no scalar fallback is needed.

#include <array>
#include <cstddef>
#include <cstdint>

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
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kAheadBytes),
               _MM_HINT_T0);
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

// Converts the lanes of `valid` and stores them; returns the lanes that
// overflow (kError only, and then nothing is stored).
template <Fp16Overflow kOverflow>
__mmask16 F32ToF16Lanes(const float* src, uint16_t* dst, __mmask16 valid) {
  __m512i u = _mm512_maskz_loadu_epi32(valid, src);
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32(0x80000000));
  const __m512i inf = _mm512_set1_epi32(0x7F800000);
  // VCVTPS2PH keeps a NaN's payload; the contract wants the plain quiet NaN.
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, inf);
  u = _mm512_mask_mov_epi32(u, nan, _mm512_or_si512(sign, _mm512_set1_epi32(0x7FC00000)));
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
  _mm256_mask_storeu_epi16(dst, valid, half);
  return 0;
}

template <Fp16Overflow kOverflow>
size_t F32ToF16(const float* src, uint16_t* dst, size_t n) {
  size_t i = ToLine(src, n);
  if (i > 0) {
    const __mmask16 big = F32ToF16Lanes<kOverflow>(src, dst, FirstLanes(i));
    if (big != 0) return __builtin_ctz(big);
  }
  for (; i + 32 <= n; i += 32) {  // two vectors a turn, as for bf16
    PrefetchAhead(src + i);
    PrefetchAhead(src + i + 16);
    const __mmask16 big = F32ToF16Lanes<kOverflow>(src + i, dst + i, 0xFFFF);
    if (big != 0) return i + __builtin_ctz(big);
    const __mmask16 big2 = F32ToF16Lanes<kOverflow>(src + i + 16, dst + i + 16, 0xFFFF);
    if (big2 != 0) return i + 16 + __builtin_ctz(big2);
  }
  for (; i < n; i += 16) {
    const __mmask16 big = F32ToF16Lanes<kOverflow>(src + i, dst + i, FirstLanes(n - i));
    if (big != 0) return i + __builtin_ctz(big);
  }
  return n;
}

}  // namespace

void F32ToBF16Avx512(const float* src, uint16_t* dst, size_t n) {
  // Odd 16-bit words of the two inputs: the high halves, in order.
  alignas(64) static constexpr uint16_t kHighHalves[32] = {
      1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
      33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i high_halves = _mm512_load_si512(kHighHalves);
  size_t i = ToLine(src, n);
  if (i > 0) {
    const __mmask16 valid = FirstLanes(i);
    const __m512i rounded = RoundToBF16High(_mm512_maskz_loadu_epi32(valid, src));
    _mm512_mask_cvtepi32_storeu_epi16(dst, valid, _mm512_srli_epi32(rounded, 16));
  }
  for (; i + 32 <= n; i += 32) {
    PrefetchAhead(src + i);
    PrefetchAhead(src + i + 16);
    const __m512i lo = RoundToBF16High(_mm512_loadu_si512(src + i));
    const __m512i hi = RoundToBF16High(_mm512_loadu_si512(src + i + 16));
    _mm512_storeu_si512(dst + i, _mm512_permutex2var_epi16(lo, high_halves, hi));
  }
  for (; i < n; i += 16) {
    const __mmask16 valid = FirstLanes(n - i);
    const __m512i rounded = RoundToBF16High(_mm512_maskz_loadu_epi32(valid, src + i));
    _mm512_mask_cvtepi32_storeu_epi16(dst + i, valid, _mm512_srli_epi32(rounded, 16));
  }
}

size_t F32ToF16Avx512(const float* src, uint16_t* dst, size_t n, Fp16Overflow overflow) {
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

namespace {

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

// Counting in 32-bit lanes and summing in fp32 lanes, flushed into `error`
// every kSumBlock elements: 4096 / 16 terms a lane keep the fp32 sum within
// about 2^-16 of exact.
constexpr size_t kSumBlock = 4096;

// Bucket counts four bits each, all eight in a lane: entry i of the table
// has a 1 in field j when bucket index i (cast_kernels.h) exceeds bound j,
// so one lookup and one add count every bucket; the fields are added into
// 32-bit counts every 15 vectors, before they can overflow.
constexpr int kTableEntries = 32;
constexpr int kNibbleFlush = 15;

constexpr std::array<uint32_t, kTableEntries> AboveTable() {
  std::array<uint32_t, kTableEntries> table{};
  for (int index = 0; index < kTableEntries; ++index) {
    for (int j = 0; j < BoundsExceeded(index); ++j) table[index] |= 1u << (4 * j);
  }
  return table;
}
constexpr std::array<uint32_t, kTableEntries> kAboveTable = AboveTable();
static_assert(kBucketIndexBelow == kTableEntries - 1);

template <bool kBF16>
void MeasureNarrowing(const float* src, const uint16_t* out, size_t n,
                      const NarrowingLimits& limits, CastError* error) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i overflow_floor = _mm512_set1_epi32(static_cast<int>(limits.overflow_floor));
  const __m512i below_normal = _mm512_set1_epi32(static_cast<int>(limits.normal_floor - 1));
  const __m512i normal_floor = _mm512_set1_epi32(static_cast<int>(limits.normal_floor));
  const __m512i normal_span =
      _mm512_set1_epi32(static_cast<int>(limits.overflow_floor - limits.normal_floor));
  const __m512i table_low = _mm512_loadu_si512(kAboveTable.data());
  const __m512i table_high = _mm512_loadu_si512(kAboveTable.data() + 16);
  const __m512i index_offset = _mm512_set1_epi32(-1 - (kBucketIndexBias << 23));
  const __m512i last_entry = _mm512_set1_epi32(kBucketIndexBelow);
  const __m512i nibble = _mm512_set1_epi32(0xF);
  error->elements += n;
  for (size_t begin = 0; begin < n; begin += kSumBlock) {
    const size_t end = n - begin < kSumBlock ? n : begin + kSumBlock;
    __m512i overflowed = _mm512_setzero_si512(), flushed = overflowed, subnormal = overflowed,
            measured = overflowed, nibbles = overflowed;
    __m512i above[CastError::kBuckets];
    for (__m512i& count : above) count = _mm512_setzero_si512();
    auto flush_nibbles = [&] {
      for (int j = 0; j < CastError::kBuckets; ++j) {
        above[j] =
            _mm512_add_epi32(above[j], _mm512_and_si512(_mm512_srli_epi32(nibbles, 4 * j), nibble));
      }
      nibbles = _mm512_setzero_si512();
    };
    __m512 sum = _mm512_setzero_ps(), max = sum;
    int pending = 0;
    for (size_t i = begin; i < end; i += 16) {
      const __mmask16 valid = FirstLanes(end - i);
      const __m512i x = _mm512_maskz_loadu_epi32(valid, src + i);
      const __m512 cast = Lanes<kBF16>(_mm256_maskz_loadu_epi16(valid, out + i));
      const __m512i a = _mm512_and_si512(x, abs_mask);
      // Most vectors hold only values at or above the dtype's least normal
      // and below its overflow: each is measured and none lost. (Masked-off
      // lanes are 0, below the range, so a tail takes the long way.)
      __mmask16 kept = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, normal_floor), normal_span);
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
        overflowed = _mm512_mask_add_epi32(overflowed, over, overflowed, one);
        flushed = _mm512_mask_add_epi32(flushed, zero, flushed, one);
        subnormal = _mm512_mask_add_epi32(subnormal, became_subnormal, subnormal, one);
      }
      measured = _mm512_mask_add_epi32(measured, kept, measured, one);
      const __m512 difference = _mm512_sub_ps(cast, _mm512_castsi512_ps(x));
      const __m512 relative = _mm512_maskz_div_ps(
          kept, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(difference), abs_mask)),
          _mm512_castsi512_ps(a));
      const __m512i index = _mm512_min_epu32(
          _mm512_srai_epi32(_mm512_add_epi32(_mm512_castps_si512(relative), index_offset), 23),
          last_entry);
      nibbles = _mm512_add_epi32(nibbles, _mm512_permutex2var_epi32(table_low, index, table_high));
      if (++pending == kNibbleFlush) {
        flush_nibbles();
        pending = 0;
      }
      sum = _mm512_add_ps(sum, relative);
      max = _mm512_max_ps(max, relative);
    }
    flush_nibbles();
    error->overflowed += static_cast<uint32_t>(_mm512_reduce_add_epi32(overflowed));
    error->flushed_to_zero += static_cast<uint32_t>(_mm512_reduce_add_epi32(flushed));
    error->became_subnormal += static_cast<uint32_t>(_mm512_reduce_add_epi32(subnormal));
    error->measured += static_cast<uint32_t>(_mm512_reduce_add_epi32(measured));
    for (int k = 0; k < CastError::kBuckets; ++k) {
      error->above[k] += static_cast<uint32_t>(_mm512_reduce_add_epi32(above[k]));
    }
    error->relative_error_sum += _mm512_reduce_add_ps(sum);
    const float block_max = _mm512_reduce_max_ps(max);
    if (block_max > error->max_relative_error) error->max_relative_error = block_max;
  }
}

}  // namespace

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
