#pragma once

// The fp8 quantization kernels (core/fp8.h), one per instruction set, and the
// constants they share. Internal to core.

#include <cstddef>
#include <cstdint>

#include "core/fp8.h"

namespace layercast::internal {

// A format's constants, as fp32 bit patterns where the kernels compare
// magnitudes as integers (a non-negative float orders as its bits).
struct Fp8Spec {
  int mantissa_bits;
  // Shifting an fp32 magnitude right by 23 - mantissa_bits leaves its
  // exponent and the format's mantissa; subtracting this rebiases it.
  uint32_t rebias;
  uint32_t max_finite_bits;  // fp32 bits of 448 / 57344
  uint32_t min_normal_bits;  // fp32 bits of 2^-6 / 2^-14
  // fp32 bits of 2^(e_min - mantissa_bits + 23): adding it to a magnitude
  // below the least normal leaves the subnormal code, rounded to nearest
  // even, in its low bits (its ulp is the format's subnormal step).
  uint32_t subnormal_magic_bits;
  // fp32 bits of the largest magnitude that rounds to at most max_finite
  // (464, a tie going to 448's even code; just below 61440, a tie going to
  // infinity's even code): beyond it, saturating changed the result.
  uint32_t saturation_floor_bits;
  uint8_t max_code;
  uint8_t nan_code;
};

inline constexpr Fp8Spec kE4M3FNSpec = {3,          120u << 3,  0x43E00000, 0x3C800000,
                                        0x46800000, 0x43E80000, 0x7E,       0x7F};
inline constexpr Fp8Spec kE5M2Spec = {2,          112u << 2,  0x47600000, 0x38800000,
                                      0x43000000, 0x476FFFFF, 0x7B,       0x7E};

// Out of line in fp8.cc: shared by every kernel file (see cast_kernels.h on
// inline functions in files compiled for other instruction sets).
const Fp8Spec& SpecOf(Fp8Format format);
// The scale of a block whose largest finite magnitude is `amax` (core/fp8.h).
float Fp8ScaleFromAbsMax(float amax, Fp8Format format);

// Quantizes with one scale.
void QuantizeFp8Scalar(const float* src, size_t n, float scale, const Fp8Spec& spec, uint8_t* dst);
void QuantizeFp8Avx2(const float* src, size_t n, float scale, const Fp8Spec& spec, uint8_t* dst);
void QuantizeFp8Avx512(const float* src, size_t n, float scale, const Fp8Spec& spec, uint8_t* dst);
// QuantizeFp8: blocks of block_size from src[0], each block's scale into
// scales[], and with `error` each block measured right after it is written.
void QuantizeFp8BlocksScalar(const float* src, size_t n, size_t block_size, Fp8Format format,
                             uint8_t* dst, float* scales, CastError* error);
void QuantizeFp8BlocksAvx2(const float* src, size_t n, size_t block_size, Fp8Format format,
                           uint8_t* dst, float* scales, CastError* error);
void QuantizeFp8BlocksAvx512(const float* src, size_t n, size_t block_size, Fp8Format format,
                             uint8_t* dst, float* scales, CastError* error);
// Every code's value (256 floats), for dequantizing and measuring.
const float* Fp8DecodeTable(Fp8Format format);
// MeasureFp8Error (core/fp8.h) of n elements: identical counts and maximum,
// the sum added in another order.
void MeasureFp8ErrorScalar(const float* src, const uint8_t* q, size_t n, float scale,
                           Fp8Format format, CastError* error);
void MeasureFp8ErrorAvx512(const float* src, const uint8_t* q, size_t n, float scale,
                           Fp8Format format, CastError* error);
// The largest finite |x| of src[0..n), 0 if none.
float FiniteAbsMaxScalar(const float* src, size_t n);
float FiniteAbsMaxAvx2(const float* src, size_t n);
float FiniteAbsMaxAvx512(const float* src, size_t n);

}  // namespace layercast::internal
