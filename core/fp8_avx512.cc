// fp8 quantization with AVX-512 F and BW: 16 elements a turn, masked for the
// tail, giving EncodeFp8's codes (core/fp8.cc) by the FP adder's rounding
// (Encode below), and the cast-error measurement fused into it.

#include <algorithm>
#include <bit>
#include <iterator>
#include <limits>

#include "core/cast_error.h"
#include "core/cast_error_avx512.h"
#include "core/fp8_kernels.h"
#include "core/x86_intrinsics.h"

namespace layercast::internal {
namespace {

struct Constants {
  explicit Constants(const Fp8Spec& spec)
      : magnitude_mask(_mm512_set1_epi32(0x7FFFFFFF)),
        infinity(_mm512_set1_epi32(0x7F800000)),
        max_finite(_mm512_set1_epi32(static_cast<int>(spec.max_finite_bits))),
        min_normal(_mm512_set1_epi32(static_cast<int>(spec.min_normal_bits))),
        to_step(_mm512_set1_epi32((23 - spec.mantissa_bits) << 23)),
        // The least normal binade's exponent, shifted as Encode shifts a
        // lane's: the difference counts the binades above it, in codes.
        least_normal_field(
            _mm512_set1_epi32(static_cast<int>(spec.min_normal_bits >> (23 - spec.mantissa_bits)))),
        nan_code(_mm512_set1_epi32(spec.nan_code)),
        sign_bit(_mm512_set1_epi32(0x80)),
        shift(23 - spec.mantissa_bits) {}
  __m512i magnitude_mask, infinity, max_finite, min_normal, to_step, least_normal_field, nan_code,
      sign_bit;
  int shift;
};

// Codes in the low byte of each lane. kFinite: no lane of x is NaN or
// infinite and |x / scale| rounds to at most the largest finite code (a
// block under its own scale), so neither needs a test.
//
// The FP adder rounds: for y in binade 2^e (e at least the format's least
// normal exponent), y + 2^(e + 23 - mantissa_bits) is y rounded to nearest
// even at the format's step 2^(e - mantissa_bits), and the sum's bits less
// the addend's count the steps: 8..16 above 2^e for a normal e4m3 (16 when
// rounding carries into the next binade), 0..8 for a subnormal one. The
// scalar kernel's integer rounding and subnormal magic, in one path.
// Sets `*rounded` (kFinite only) to |x / scale| rounded to the format, the
// code's value, for the measurement.
template <bool kFinite>
inline __m512i Encode(__m512 x, __m512 scale, const Constants& c, __m512* rounded) {
  const __m512i bits = _mm512_castps_si512(_mm512_div_ps(x, scale));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), c.sign_bit);
  __m512i magnitude = _mm512_and_si512(bits, c.magnitude_mask);
  __mmask16 nan = 0;
  if constexpr (!kFinite) {
    nan = _mm512_cmpgt_epu32_mask(magnitude, c.infinity);
    magnitude = _mm512_min_epu32(magnitude, c.max_finite);
  }
  const __m512i binade = _mm512_max_epu32(_mm512_and_si512(magnitude, c.infinity), c.min_normal);
  const __m512i addend = _mm512_add_epi32(binade, c.to_step);
  const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(magnitude), _mm512_castsi512_ps(addend));
  const __m512i steps = _mm512_sub_epi32(_mm512_castps_si512(sum), addend);
  if constexpr (kFinite) {
    // The sum lies within twice the addend, so this subtraction is exact.
    *rounded = _mm512_sub_ps(sum, _mm512_castsi512_ps(addend));
  }
  __m512i code = _mm512_add_epi32(
      steps, _mm512_sub_epi32(_mm512_srli_epi32(binade, c.shift), c.least_normal_field));
  if constexpr (!kFinite) code = _mm512_mask_mov_epi32(code, nan, c.nan_code);
  return _mm512_or_si512(code, sign);
}

// One run under one scale, in every lane of `scale`. measure(x, codes,
// rounded, lanes) sees each vector as it is quantized (kFinite only).
template <bool kFinite, typename Measure>
inline void Quantize(const float* src, size_t n, __m512 scale, const Constants& c, uint8_t* dst,
                     Measure&& measure) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    __m512 rounded;
    const __m512i codes = Encode<kFinite>(x, scale, c, &rounded);
    // Not a masked VPMOVDB to memory: AMD Zen 4 and 5 run that slowly.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(codes));
    if constexpr (kFinite) measure(x, codes, rounded, __mmask16{0xFFFF});
  }
  if (i < n) {
    const auto lanes = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, src + i);
    __m512 rounded;
    const __m512i codes = Encode<kFinite>(x, scale, c, &rounded);
    _mm512_mask_cvtepi32_storeu_epi8(dst + i, lanes, codes);
    if constexpr (kFinite) measure(x, codes, rounded, lanes);
  }
}

template <bool kFinite>
inline void Quantize(const float* src, size_t n, __m512 scale, const Constants& c, uint8_t* dst) {
  Quantize<kFinite>(src, n, scale, c, dst, [](__m512, __m512i, __m512, __mmask16) {});
}

// The largest |x| of src[0..n) in every lane, as bits: of finite x only (0
// if none) with kFiniteOnly; otherwise of every x, so that an infinity or a
// NaN shows as bits at or above infinity's.
template <bool kFiniteOnly>
inline __m512i AbsMaxLanes(const float* src, size_t n) {
  const __m512i magnitude_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i infinity = _mm512_set1_epi32(0x7F800000);
  __m512i max_bits = _mm512_setzero_si512();
  auto take = [&](__m512i magnitude) {
    if constexpr (kFiniteOnly) {
      max_bits = _mm512_mask_max_epu32(max_bits, _mm512_cmplt_epu32_mask(magnitude, infinity),
                                       max_bits, magnitude);
    } else {
      max_bits = _mm512_max_epu32(max_bits, magnitude);
    }
  };
  size_t i = 0;
  for (; i + 16 <= n; i += 16) take(_mm512_and_si512(_mm512_loadu_si512(src + i), magnitude_mask));
  if (i < n) {
    const auto tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    take(_mm512_and_si512(_mm512_maskz_loadu_epi32(tail, src + i), magnitude_mask));
  }
  // Across the lanes in registers: through memory and std::max_element, a
  // block of 128 paid a mispredicted compare or two (docs/performance.md,
  // "fp8 quantization").
  max_bits = _mm512_max_epu32(max_bits, _mm512_shuffle_i32x4(max_bits, max_bits, 0x4E));
  max_bits = _mm512_max_epu32(max_bits, _mm512_shuffle_i32x4(max_bits, max_bits, 0xB1));
  max_bits = _mm512_max_epu32(max_bits, _mm512_shuffle_epi32(max_bits, _MM_PERM_BADC));
  return _mm512_max_epu32(max_bits, _mm512_shuffle_epi32(max_bits, _MM_PERM_CDAB));
}

// Fp8ScaleFromAbsMax lane by lane, kept in registers between a block's
// maximum and its quantization instead of a call to fp8.cc per block.
// Fp8Test.EveryKernelGivesTheScalarOnesScalesAndCodes compares it with the
// scalar kernel's.
inline __m512 ScaleLanes(__m512i amax_bits, __m512 max_finite) {
  const __m512 scale = _mm512_max_ps(_mm512_div_ps(_mm512_castsi512_ps(amax_bits), max_finite),
                                     _mm512_set1_ps(std::numeric_limits<float>::min()));
  return _mm512_mask_mov_ps(scale, _mm512_testn_epi32_mask(amax_bits, amax_bits),
                            _mm512_set1_ps(1.0f));
}

// Of the lanes of `in_range`: those whose code is a zero (flushed), and those
// whose x was a normal fp32 and whose code is a subnormal (became subnormal).
struct RareLosses {
  __mmask16 flushed, became_subnormal;
};
inline RareLosses RareLossesOf(__mmask16 in_range, __m512i x_magnitude, __m512i codes,
                               __m512i least_normal_code) {
  const __m512i code_magnitude = _mm512_and_si512(codes, _mm512_set1_epi32(0x7F));
  const __mmask16 flushed =
      _mm512_mask_cmpeq_epi32_mask(in_range, code_magnitude, _mm512_setzero_si512());
  const __mmask16 became_subnormal =
      _mm512_mask_cmpge_epu32_mask(in_range, x_magnitude, _mm512_set1_epi32(0x00800000)) &
      _mm512_cmplt_epu32_mask(code_magnitude, least_normal_code) & static_cast<__mmask16>(~flushed);
  return {flushed, became_subnormal};
}

// What MeasureFp8ErrorAvx512 adds up, kept across the blocks of one
// QuantizeFp8 call so that a block of 128 does not pay for a CastError::Add
// and a reduction of its own. The lanes' sums go into the double every
// 4096 elements, as CastError's sum is defined. Callers count `elements`.
class ErrorMeter {
 public:
  explicit ErrorMeter(Fp8Format format)
      : decode_(Fp8DecodeTable(format)),
        magnitude_mask_(_mm512_set1_epi32(0x7FFFFFFF)),
        infinity_(_mm512_set1_epi32(0x7F800000)),
        saturation_floor_(
            _mm512_set1_epi32(static_cast<int>(SpecOf(format).saturation_floor_bits))),
        least_normal_code_(_mm512_set1_epi32(1 << SpecOf(format).mantissa_bits)) {}

  void Measure(const float* src, const uint8_t* q, size_t n, float scale) {
    const __m512 scale_vector = _mm512_set1_ps(scale);
    for (size_t i = 0; i < n; i += 16) {
      const auto lanes = static_cast<__mmask16>(n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(lanes, src + i);
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, q + i));
      const __m512i x_magnitude = _mm512_and_si512(_mm512_castps_si512(x), magnitude_mask_);
      // Finite and nonzero, as the scalar kernel's first test.
      const __mmask16 counted = _mm512_mask_cmplt_epu32_mask(lanes, x_magnitude, infinity_) &
                                _mm512_test_epi32_mask(x_magnitude, x_magnitude);
      const __m512i y_magnitude =
          _mm512_and_si512(_mm512_castps_si512(_mm512_div_ps(x, scale_vector)), magnitude_mask_);
      const __mmask16 saturated =
          _mm512_mask_cmpgt_epu32_mask(counted, y_magnitude, saturation_floor_);
      const __mmask16 in_range = counted & static_cast<__mmask16>(~saturated);

      const RareLosses rare = RareLossesOf(in_range, x_magnitude, codes, least_normal_code_);

      const __m512 cast = _mm512_mul_ps(_mm512_i32gather_ps(codes, decode_, 4), scale_vector);
      const __m512 difference = _mm512_castsi512_ps(
          _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(cast, x)), magnitude_mask_));
      const __m512 relative =
          _mm512_maskz_div_ps(in_range, difference, _mm512_castsi512_ps(x_magnitude));
      sum_ = _mm512_add_ps(sum_, relative);
      max_ = _mm512_max_ps(max_, relative);
      for (int k = 0; k < CastError::kBuckets; ++k) {
        piece_.above[k] += __builtin_popcount(_mm512_mask_cmp_ps_mask(
            in_range, relative, _mm512_set1_ps(CastError::kBounds[k]), _CMP_GT_OQ));
      }
      piece_.overflowed += __builtin_popcount(saturated);
      piece_.measured += __builtin_popcount(in_range);
      piece_.flushed_to_zero += __builtin_popcount(rare.flushed);
      piece_.became_subnormal += __builtin_popcount(rare.became_subnormal);
    }
    unflushed_ += n;
    if (unflushed_ >= 4096) FlushSum();
  }

  void AddTo(CastError* error) {
    FlushSum();
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, max_);
    piece_.max_relative_error = *std::max_element(std::begin(lanes), std::end(lanes));
    error->Add(piece_);
  }

 private:
  // Through memory: GCC 12's reductions trip -Wuninitialized in its own
  // header (bug 105593).
  void FlushSum() {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, sum_);
    for (float lane : lanes) piece_.relative_error_sum += lane;
    sum_ = _mm512_setzero_ps();
    unflushed_ = 0;
  }

  const float* decode_;
  __m512i magnitude_mask_, infinity_, saturation_floor_, least_normal_code_;
  __m512 sum_ = _mm512_setzero_ps(), max_ = _mm512_setzero_ps();
  size_t unflushed_ = 0;
  CastError piece_;
};

}  // namespace

void QuantizeFp8Avx512(const float* src, size_t n, float scale, const Fp8Spec& spec, uint8_t* dst) {
  Quantize<false>(src, n, _mm512_set1_ps(scale), Constants(spec), dst);
}

[[gnu::flatten]] void QuantizeFp8BlocksAvx512(const float* src, size_t n, size_t block_size,
                                              Fp8Format format, uint8_t* dst, float* scales,
                                              CastError* error) {
  const Constants c(SpecOf(format));
  const __m512 max_finite = _mm512_set1_ps(Fp8MaxFinite(format));
  // measure_finite(x, codes, rounded, scale, lanes) sees each vector of a
  // block with no infinity or NaN as it is quantized; `meter` measures the
  // others after them.
  auto blocks = [&](auto&& measure_finite, ErrorMeter* meter) __attribute__((always_inline)) {
    for (size_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
      const size_t length = std::min(block_size, n - begin);
      // Most blocks hold no infinity or NaN: one plain maximum finds that
      // out, and they quantize without a test for either.
      __m512i amax = AbsMaxLanes<false>(src + begin, length);
      const bool finite = _mm512_cmplt_epu32_mask(amax, c.infinity) != 0;
      if (!finite) amax = AbsMaxLanes<true>(src + begin, length);
      const __m512 scale = ScaleLanes(amax, max_finite);
      scales[block] = _mm512_cvtss_f32(scale);
      if (finite) {
        Quantize<true>(src + begin, length, scale, c, dst + begin,
                       [&](__m512 x, __m512i codes, __m512 rounded, __mmask16 lanes) {
                         measure_finite(x, codes, rounded, scale, lanes);
                       });
      } else {
        Quantize<false>(src + begin, length, scale, c, dst + begin);
        if (meter != nullptr) meter->Measure(src + begin, dst + begin, length, scales[block]);
      }
    }
  };
  if (error == nullptr) {
    blocks([](__m512, __m512i, __m512, __m512, __mmask16) {}, nullptr);
    return;
  }
  // Blocks with no infinity or NaN, measured from the quantizer's registers:
  // none saturates under its block's scale, and the cast is `rounded` (the
  // code's value) times the scale, with x's sign.
  ErrorMeter meter(format);
  avx512::MeasureLoss(error, [&](auto& add_loss, auto& skip) {
    const __m512i magnitude_mask = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i least_normal_code = _mm512_set1_epi32(1 << SpecOf(format).mantissa_bits);
    // x is at least the format's least normal times the scale exactly when
    // x times its inverse (a power of two: exact) is at least the scale.
    const __m512 inverse_least_normal =
        _mm512_set1_ps(1.0f / std::bit_cast<float>(SpecOf(format).min_normal_bits));
    blocks(
        [&](__m512 x, __m512i codes, __m512 rounded, __m512 scale, __mmask16 lanes) {
          const __m512i a = _mm512_and_si512(_mm512_castps_si512(x), magnitude_mask);
          // Lanes in the normal range lose at most the unit roundoff: a
          // whole vector of them is measured only in the sample. (Zero
          // lanes are below it, and so is a tail's.)
          const __mmask16 normal = _mm512_mask_cmp_ps_mask(
              lanes, _mm512_mul_ps(_mm512_castsi512_ps(a), inverse_least_normal), scale,
              _CMP_GE_OQ);
          if (skip(normal)) [[likely]]
            return;
          const __mmask16 counted = _mm512_mask_test_epi32_mask(lanes, a, a);
          const RareLosses rare = RareLossesOf(counted, a, codes, least_normal_code);
          add_loss(counted, a, _mm512_sub_ps(_mm512_mul_ps(rounded, scale), _mm512_castsi512_ps(a)),
                   0, std::popcount(static_cast<unsigned>(rare.flushed)),
                   std::popcount(static_cast<unsigned>(rare.became_subnormal)));
        },
        &meter);
  });
  meter.AddTo(error);
  error->elements += n;
}

void MeasureFp8ErrorAvx512(const float* src, const uint8_t* q, size_t n, float scale,
                           Fp8Format format, CastError* error) {
  ErrorMeter meter(format);
  meter.Measure(src, q, n, scale);
  meter.AddTo(error);
  error->elements += n;
}

float FiniteAbsMaxAvx512(const float* src, size_t n) {
  return std::bit_cast<float>(_mm_cvtsi128_si32(_mm512_castsi512_si128(AbsMaxLanes<true>(src, n))));
}

}  // namespace layercast::internal
