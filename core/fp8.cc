#include "core/fp8.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cassert>
#include <cmath>
#include <limits>

#include "core/cast_dispatch.h"
#include "core/cast_error.h"
#include "core/fp8_kernels.h"

namespace layercast {
namespace {

using internal::Fp8Spec;

using internal::SpecOf;

// Every code's value, for dequantizing and measuring.
const std::array<float, 256>& DecodeTable(Fp8Format format) {
  static const auto make = [](Fp8Format f) {
    std::array<float, 256> table;
    for (int code = 0; code < 256; ++code) table[code] = Fp8ToF32(static_cast<uint8_t>(code), f);
    return table;
  };
  static const std::array<float, 256> e4m3fn = make(Fp8Format::kE4M3FN);
  static const std::array<float, 256> e5m2 = make(Fp8Format::kE5M2);
  return format == Fp8Format::kE4M3FN ? e4m3fn : e5m2;
}

// One variant's kernels, as cast.cc keeps the 16-bit casts'.
struct Kernels {
  void (*quantize)(const float*, size_t, float, const Fp8Spec&, uint8_t*);
  void (*quantize_blocks)(const float*, size_t, size_t, Fp8Format, uint8_t*, float*, CastError*);
  float (*finite_abs_max)(const float*, size_t);
  void (*measure)(const float*, const uint8_t*, size_t, float, Fp8Format, CastError*);
};
// AVX2 measures with the scalar kernel: it has no vector one.
constexpr Kernels kScalarKernels = {internal::QuantizeFp8Scalar, internal::QuantizeFp8BlocksScalar,
                                    internal::FiniteAbsMaxScalar, internal::MeasureFp8ErrorScalar};
constexpr Kernels kAvx2Kernels = {internal::QuantizeFp8Avx2, internal::QuantizeFp8BlocksAvx2,
                                  internal::FiniteAbsMaxAvx2, internal::MeasureFp8ErrorScalar};
constexpr Kernels kAvx512Kernels = {internal::QuantizeFp8Avx512, internal::QuantizeFp8BlocksAvx512,
                                    internal::FiniteAbsMaxAvx512, internal::MeasureFp8ErrorAvx512};

// The kernels `isa` names: kAvx512Bf16 runs the AVX-512 ones; a variant this
// CPU lacks runs the scalar ones (same bits, no SIGILL).
const Kernels& KernelsFor(CastIsa isa) {
  static const bool avx2 = internal::CpuRunsIsa(CastIsa::kAvx2);
  static const bool avx512 = internal::CpuRunsIsa(CastIsa::kAvx512);
  if ((isa == CastIsa::kAvx512 || isa == CastIsa::kAvx512Bf16) && avx512) return kAvx512Kernels;
  if (isa == CastIsa::kAvx2 && avx2) return kAvx2Kernels;
  return kScalarKernels;
}

// The widest variant's: wider was faster at every fp8 kernel measured
// (cast_bench).
const Kernels& WidestKernels() {
  static const Kernels& kernels = KernelsFor(SupportedCastIsas().back());
  return kernels;
}

// One element, already divided by its scale: the code as core/fp8.h defines
// it. The AVX2 kernel does the same steps lane by lane; the AVX-512 one
// rounds by the FP adder instead (core/fp8_avx512.cc), to the same codes.
// (Here, not in fp8_kernels.h: an inline function there would also be
// compiled with AVX-512 in fp8_avx512.cc, and the linker may keep either.)
uint8_t EncodeFp8(float y, const Fp8Spec& spec) {
  const uint32_t bits = std::bit_cast<uint32_t>(y);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  uint32_t magnitude = bits & 0x7FFFFFFF;
  if (magnitude > 0x7F800000) return sign | spec.nan_code;
  if (magnitude > spec.max_finite_bits) magnitude = spec.max_finite_bits;  // saturate
  if (magnitude < spec.min_normal_bits) {
    const float sum =
        std::bit_cast<float>(magnitude) + std::bit_cast<float>(spec.subnormal_magic_bits);
    return sign | static_cast<uint8_t>(std::bit_cast<uint32_t>(sum) - spec.subnormal_magic_bits);
  }
  const int shift = 23 - spec.mantissa_bits;
  const uint32_t rounded = magnitude + ((1u << (shift - 1)) - 1) + ((magnitude >> shift) & 1);
  return sign | static_cast<uint8_t>((rounded >> shift) - spec.rebias);
}

bool IsSubnormalCode(uint8_t code, const Fp8Spec& spec) {
  const int exponent_shift = spec.mantissa_bits;
  return ((code & 0x7F) >> exponent_shift) == 0 && (code & 0x7F) != 0;
}

}  // namespace

Fp8Format Fp8FormatOf(DType dtype) {
  assert(IsFloat8(dtype));
  return dtype == DType::kFloat8E5M2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3FN;
}

absl::string_view Fp8FormatName(Fp8Format format) {
  return format == Fp8Format::kE4M3FN ? "float8_e4m3fn" : "float8_e5m2";
}

float Fp8MaxFinite(Fp8Format format) { return format == Fp8Format::kE4M3FN ? 448.0f : 57344.0f; }

float Fp8ToF32(uint8_t code, Fp8Format format) {
  const Fp8Spec& spec = SpecOf(format);
  const float sign = (code & 0x80) != 0 ? -1.0f : 1.0f;
  const int mantissa_bits = spec.mantissa_bits;
  const int exponent_bits = 7 - mantissa_bits;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const int exponent = (code & 0x7F) >> mantissa_bits;
  const int mantissa = code & ((1 << mantissa_bits) - 1);
  if (format == Fp8Format::kE4M3FN && (code & 0x7F) == 0x7F) {
    return std::copysign(std::numeric_limits<float>::quiet_NaN(), sign);
  }
  if (format == Fp8Format::kE5M2 && exponent == 0x1F) {
    return mantissa == 0 ? sign * std::numeric_limits<float>::infinity()
                         : std::copysign(std::numeric_limits<float>::quiet_NaN(), sign);
  }
  // Both branches are exact: at most 4 significant bits, exponents well
  // inside fp32's range.
  if (exponent == 0)
    return sign * std::ldexp(static_cast<float>(mantissa), 1 - bias - mantissa_bits);
  return sign * std::ldexp(static_cast<float>(mantissa + (1 << mantissa_bits)),
                           exponent - bias - mantissa_bits);
}

float Fp8BlockScale(std::span<const float> block, Fp8Format format) {
  return internal::Fp8ScaleFromAbsMax(WidestKernels().finite_abs_max(block.data(), block.size()),
                                      format);
}

void QuantizeFp8WithScale(std::span<const float> src, float scale, Fp8Format format,
                          std::span<uint8_t> dst) {
  QuantizeFp8WithScale(src, scale, format, dst, SupportedCastIsas().back());
}

void QuantizeFp8WithScale(std::span<const float> src, float scale, Fp8Format format,
                          std::span<uint8_t> dst, CastIsa isa) {
  assert(src.size() == dst.size());
  KernelsFor(isa).quantize(src.data(), std::min(src.size(), dst.size()), scale, SpecOf(format),
                           dst.data());
}

void QuantizeFp8(std::span<const float> src, size_t block_size, Fp8Format format,
                 std::span<uint8_t> dst, std::span<float> scales, CastError* error) {
  QuantizeFp8(src, block_size, format, dst, scales, error, SupportedCastIsas().back());
}

void QuantizeFp8(std::span<const float> src, size_t block_size, Fp8Format format,
                 std::span<uint8_t> dst, std::span<float> scales, CastError* error, CastIsa isa) {
  assert(block_size > 0 && dst.size() == src.size() &&
         scales.size() == Fp8BlockCount(src.size(), block_size));
  KernelsFor(isa).quantize_blocks(src.data(), std::min(src.size(), dst.size()), block_size, format,
                                  dst.data(), scales.data(), error);
}

void DequantizeFp8(std::span<const uint8_t> src, size_t block_size, std::span<const float> scales,
                   Fp8Format format, std::span<float> dst) {
  assert(block_size > 0 && dst.size() == src.size() &&
         scales.size() == Fp8BlockCount(src.size(), block_size));
  const std::array<float, 256>& values = DecodeTable(format);
  for (size_t i = 0; i < src.size(); ++i) dst[i] = values[src[i]] * scales[i / block_size];
}

void MeasureFp8Error(std::span<const float> src, std::span<const uint8_t> q, float scale,
                     Fp8Format format, CastError* error) {
  assert(src.size() == q.size());
  WidestKernels().measure(src.data(), q.data(), std::min(src.size(), q.size()), scale, format,
                          error);
}

namespace internal {

const Fp8Spec& SpecOf(Fp8Format format) {
  return format == Fp8Format::kE4M3FN ? kE4M3FNSpec : kE5M2Spec;
}

float Fp8ScaleFromAbsMax(float amax, Fp8Format format) {
  if (amax == 0.0f) return 1.0f;
  return std::max(amax / Fp8MaxFinite(format), std::numeric_limits<float>::min());
}

const float* Fp8DecodeTable(Fp8Format format) { return DecodeTable(format).data(); }

void MeasureFp8ErrorScalar(const float* src, const uint8_t* q, size_t n, float scale,
                           Fp8Format format, CastError* error) {
  const Fp8Spec& spec = SpecOf(format);
  const std::array<float, 256>& values = DecodeTable(format);
  CastError piece;
  piece.elements = n;
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const float x = src[i];
    if (!std::isfinite(x) || x == 0.0f) continue;
    if (std::bit_cast<uint32_t>(std::fabs(x / scale)) > spec.saturation_floor_bits) {
      ++piece.overflowed;
      continue;
    }
    const uint8_t code = q[i];
    if ((code & 0x7F) == 0) ++piece.flushed_to_zero;
    if (std::isnormal(x) && IsSubnormalCode(code, spec)) ++piece.became_subnormal;
    const float cast = values[code] * scale;
    const float relative = std::fabs(cast - x) / std::fabs(x);
    ++piece.measured;
    for (int k = 0; k < CastError::kBuckets; ++k) {
      piece.above[k] += relative > CastError::kBounds[k] ? 1 : 0;
    }
    sum += relative;
    piece.max_relative_error = std::max(piece.max_relative_error, relative);
  }
  piece.relative_error_sum = sum;
  error->Add(piece);
}

void QuantizeFp8Scalar(const float* src, size_t n, float scale, const Fp8Spec& spec, uint8_t* dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = EncodeFp8(src[i] / scale, spec);
}

void QuantizeFp8BlocksScalar(const float* src, size_t n, size_t block_size, Fp8Format format,
                             uint8_t* dst, float* scales, CastError* error) {
  const Fp8Spec& spec = SpecOf(format);
  for (size_t begin = 0; begin < n; begin += block_size) {
    const size_t length = std::min(block_size, n - begin);
    const float scale = Fp8ScaleFromAbsMax(FiniteAbsMaxScalar(src + begin, length), format);
    scales[begin / block_size] = scale;
    QuantizeFp8Scalar(src + begin, length, scale, spec, dst + begin);
    if (error != nullptr) {
      MeasureFp8ErrorScalar(src + begin, dst + begin, length, scale, format, error);
    }
  }
}

float FiniteAbsMaxScalar(const float* src, size_t n) {
  // As integers: a finite magnitude's bits order as its value and lie below
  // infinity's.
  uint32_t max_bits = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t magnitude = std::bit_cast<uint32_t>(src[i]) & 0x7FFFFFFF;
    if (magnitude < 0x7F800000) max_bits = std::max(max_bits, magnitude);
  }
  return std::bit_cast<float>(max_bits);
}

}  // namespace internal
}  // namespace layercast
