// fp8 quantization with AVX2: 8 elements a turn, the scalar EncodeFp8's steps
// lane by lane (core/fp8_kernels.h); the last few elements of a run go
// through a zero-padded vector (AVX2 has no masked byte stores).

#include <algorithm>
#include <bit>
#include <cstring>
#include <iterator>

#include "core/fp8_kernels.h"
#include "core/x86_intrinsics.h"

namespace layercast::internal {
namespace {

// Every comparison below is between magnitudes (sign bit clear), so AVX2's
// signed compares order them as unsigned ones would.
struct Constants {
  explicit Constants(const Fp8Spec& spec)
      : scale(_mm256_set1_ps(1.0f)),
        magnitude_mask(_mm256_set1_epi32(0x7FFFFFFF)),
        infinity(_mm256_set1_epi32(0x7F800000)),
        max_finite(_mm256_set1_epi32(static_cast<int>(spec.max_finite_bits))),
        min_normal(_mm256_set1_epi32(static_cast<int>(spec.min_normal_bits))),
        magic(_mm256_set1_epi32(static_cast<int>(spec.subnormal_magic_bits))),
        round_bias(_mm256_set1_epi32((1 << (22 - spec.mantissa_bits)) - 1)),
        rebias(_mm256_set1_epi32(static_cast<int>(spec.rebias))),
        nan_code(_mm256_set1_epi32(spec.nan_code)),
        sign_bit(_mm256_set1_epi32(0x80)),
        one(_mm256_set1_epi32(1)),
        shift(_mm_cvtsi32_si128(23 - spec.mantissa_bits)) {}
  __m256 scale;  // the block's, set per block
  __m256i magnitude_mask, infinity, max_finite, min_normal, magic, round_bias, rebias, nan_code,
      sign_bit, one;
  __m128i shift;
};

// Codes in the low 8 bytes.
inline __m128i Encode(__m256 x, const Constants& c) {
  const __m256i bits = _mm256_castps_si256(_mm256_div_ps(x, c.scale));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), c.sign_bit);
  const __m256i raw = _mm256_and_si256(bits, c.magnitude_mask);
  const __m256i nan = _mm256_cmpgt_epi32(raw, c.infinity);
  const __m256i magnitude = _mm256_min_epi32(raw, c.max_finite);
  const __m256i subnormal = _mm256_cmpgt_epi32(c.min_normal, magnitude);

  const __m256i odd = _mm256_and_si256(_mm256_srl_epi32(magnitude, c.shift), c.one);
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(magnitude, c.round_bias), odd);
  __m256i code = _mm256_sub_epi32(_mm256_srl_epi32(rounded, c.shift), c.rebias);

  const __m256 sum = _mm256_add_ps(_mm256_castsi256_ps(magnitude), _mm256_castsi256_ps(c.magic));
  code = _mm256_blendv_epi8(code, _mm256_sub_epi32(_mm256_castps_si256(sum), c.magic), subnormal);
  code = _mm256_blendv_epi8(code, c.nan_code, nan);
  code = _mm256_or_si256(code, sign);
  // Each lane's low byte to the front of its 128-bit half, then the halves'
  // four bytes side by side.
  const __m256i front = _mm256_shuffle_epi8(
      code, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                             12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  return _mm_unpacklo_epi32(_mm256_castsi256_si128(front), _mm256_extracti128_si256(front, 1));
}

void Quantize(const float* src, size_t n, const Constants& c, uint8_t* dst) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), Encode(_mm256_loadu_ps(src + i), c));
  }
  if (i < n) {
    float padded[8] = {};
    std::memcpy(padded, src + i, (n - i) * sizeof(float));
    uint8_t codes[16];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), Encode(_mm256_loadu_ps(padded), c));
    std::memcpy(dst + i, codes, n - i);
  }
}

}  // namespace

void QuantizeFp8Avx2(const float* src, size_t n, float scale, const Fp8Spec& spec, uint8_t* dst) {
  Constants c(spec);
  c.scale = _mm256_set1_ps(scale);
  Quantize(src, n, c, dst);
}

void QuantizeFp8BlocksAvx2(const float* src, size_t n, size_t block_size, Fp8Format format,
                           uint8_t* dst, float* scales, CastError* error) {
  Constants c(SpecOf(format));
  for (size_t begin = 0; begin < n; begin += block_size) {
    const size_t length = std::min(block_size, n - begin);
    const float scale = Fp8ScaleFromAbsMax(FiniteAbsMaxAvx2(src + begin, length), format);
    scales[begin / block_size] = scale;
    c.scale = _mm256_set1_ps(scale);
    Quantize(src + begin, length, c, dst + begin);
    if (error != nullptr) {
      MeasureFp8ErrorScalar(src + begin, dst + begin, length, scale, format, error);
    }
  }
}

float FiniteAbsMaxAvx2(const float* src, size_t n) {
  const __m256i magnitude_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i infinity = _mm256_set1_epi32(0x7F800000);
  __m256i max_bits = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i magnitude = _mm256_and_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)), magnitude_mask);
    const __m256i finite = _mm256_cmpgt_epi32(infinity, magnitude);
    max_bits = _mm256_max_epi32(max_bits, _mm256_and_si256(magnitude, finite));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), max_bits);
  uint32_t result = *std::max_element(std::begin(lanes), std::end(lanes));
  for (; i < n; ++i) {
    const uint32_t magnitude = std::bit_cast<uint32_t>(src[i]) & 0x7FFFFFFF;
    if (magnitude < 0x7F800000) result = std::max(result, magnitude);
  }
  return std::bit_cast<float>(result);
}

}  // namespace layercast::internal
