// fp8 quantization with AVX-512 F: 16 elements a turn, the scalar EncodeFp8's
// steps lane by lane (core/fp8_kernels.h), masked for the tail.

#include <algorithm>
#include <bit>
#include <iterator>

#include "core/fp8_kernels.h"
#include "core/x86_intrinsics.h"

namespace layercast::internal {
namespace {

struct Constants {
  explicit Constants(const Fp8Spec& spec)
      : scale(_mm512_set1_ps(1.0f)),
        magnitude_mask(_mm512_set1_epi32(0x7FFFFFFF)),
        infinity(_mm512_set1_epi32(0x7F800000)),
        max_finite(_mm512_set1_epi32(static_cast<int>(spec.max_finite_bits))),
        min_normal(_mm512_set1_epi32(static_cast<int>(spec.min_normal_bits))),
        magic(_mm512_set1_epi32(static_cast<int>(spec.subnormal_magic_bits))),
        round_bias(_mm512_set1_epi32((1 << (22 - spec.mantissa_bits)) - 1)),
        rebias(_mm512_set1_epi32(static_cast<int>(spec.rebias))),
        nan_code(_mm512_set1_epi32(spec.nan_code)),
        sign_bit(_mm512_set1_epi32(0x80)),
        one(_mm512_set1_epi32(1)),
        shift(23 - spec.mantissa_bits) {}
  __m512 scale;  // the block's, set per block
  __m512i magnitude_mask, infinity, max_finite, min_normal, magic, round_bias, rebias, nan_code,
      sign_bit, one;
  int shift;
};

// Codes in the low byte of each lane.
inline __m512i Encode(__m512 x, const Constants& c) {
  const __m512i bits = _mm512_castps_si512(_mm512_div_ps(x, c.scale));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), c.sign_bit);
  const __m512i raw = _mm512_and_si512(bits, c.magnitude_mask);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(raw, c.infinity);
  const __m512i magnitude = _mm512_min_epu32(raw, c.max_finite);
  const __mmask16 subnormal = _mm512_cmplt_epu32_mask(magnitude, c.min_normal);

  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, c.shift), c.one);
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(magnitude, c.round_bias), odd);
  __m512i code = _mm512_sub_epi32(_mm512_srli_epi32(rounded, c.shift), c.rebias);

  const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(magnitude), _mm512_castsi512_ps(c.magic));
  code = _mm512_mask_sub_epi32(code, subnormal, _mm512_castps_si512(sum), c.magic);
  code = _mm512_mask_mov_epi32(code, nan, c.nan_code);
  return _mm512_or_si512(code, sign);
}

// One run under one scale, in c.scale.
void Quantize(const float* src, size_t n, const Constants& c, uint8_t* dst) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm512_cvtepi32_epi8(Encode(_mm512_loadu_ps(src + i), c)));
  }
  if (i < n) {
    const auto tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_cvtepi32_storeu_epi8(dst + i, tail,
                                     Encode(_mm512_maskz_loadu_ps(tail, src + i), c));
  }
}

}  // namespace

void QuantizeFp8Avx512(const float* src, size_t n, float scale, const Fp8Spec& spec, uint8_t* dst) {
  Constants c(spec);
  c.scale = _mm512_set1_ps(scale);
  Quantize(src, n, c, dst);
}

void QuantizeFp8BlocksAvx512(const float* src, size_t n, size_t block_size, Fp8Format format,
                             uint8_t* dst, float* scales, CastError* error) {
  Constants c(SpecOf(format));
  for (size_t begin = 0; begin < n; begin += block_size) {
    const size_t length = std::min(block_size, n - begin);
    const float scale = Fp8ScaleFromAbsMax(FiniteAbsMaxAvx512(src + begin, length), format);
    scales[begin / block_size] = scale;
    c.scale = _mm512_set1_ps(scale);
    Quantize(src + begin, length, c, dst + begin);
    if (error != nullptr) {
      MeasureFp8Error({src + begin, length}, {dst + begin, length}, scale, format, error);
    }
  }
}

float FiniteAbsMaxAvx512(const float* src, size_t n) {
  const __m512i magnitude_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i infinity = _mm512_set1_epi32(0x7F800000);
  __m512i max_bits = _mm512_setzero_si512();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i magnitude = _mm512_and_si512(_mm512_loadu_si512(src + i), magnitude_mask);
    max_bits = _mm512_mask_max_epu32(max_bits, _mm512_cmplt_epu32_mask(magnitude, infinity),
                                     max_bits, magnitude);
  }
  if (i < n) {
    const auto tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512i magnitude =
        _mm512_and_si512(_mm512_maskz_loadu_epi32(tail, src + i), magnitude_mask);
    max_bits = _mm512_mask_max_epu32(max_bits, _mm512_cmplt_epu32_mask(magnitude, infinity),
                                     max_bits, magnitude);
  }
  // Through memory: GCC 12's _mm512_reduce_max_* and unmasked 256-bit
  // extractions trip -Wuninitialized inside its own header (bug 105593).
  alignas(64) uint32_t lanes[16];
  _mm512_store_si512(lanes, max_bits);
  return std::bit_cast<float>(*std::max_element(std::begin(lanes), std::end(lanes)));
}

}  // namespace layercast::internal
