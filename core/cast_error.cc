#include "core/cast_error.h"

#include <algorithm>
#include <cassert>

#include "absl/strings/str_format.h"
#include "core/cast_kernels.h"

namespace layercast {
namespace {

const internal::NarrowingLimits& LimitsOf(DType to) {
  assert(to == DType::kBFloat16 || to == DType::kFloat16);
  return to == DType::kBFloat16 ? internal::kBF16Limits : internal::kF16Limits;
}

using MeasureKernel = void (*)(const float*, const uint16_t*, size_t,
                               const internal::NarrowingLimits&, CastError*);

MeasureKernel KernelFor(CastIsa isa) {
  const std::vector<CastIsa>& supported = SupportedCastIsas();
  auto runs = [&](CastIsa wanted) {
    return std::find(supported.begin(), supported.end(), wanted) != supported.end();
  };
  if ((isa == CastIsa::kAvx512 || isa == CastIsa::kAvx512Bf16) && runs(CastIsa::kAvx512)) {
    return internal::MeasureNarrowingAvx512;
  }
  if (isa == CastIsa::kAvx2 && runs(CastIsa::kAvx2)) return internal::MeasureNarrowingAvx2;
  return internal::MeasureNarrowingScalar;
}

}  // namespace

void CastError::Add(const CastError& other) {
  elements += other.elements;
  unmeasured += other.unmeasured;
  overflowed += other.overflowed;
  flushed_to_zero += other.flushed_to_zero;
  became_subnormal += other.became_subnormal;
  measured += other.measured;
  for (int k = 0; k < kBuckets; ++k) above[k] += other.above[k];
  relative_error_sum += other.relative_error_sum;
  max_relative_error = std::max(max_relative_error, other.max_relative_error);
}

double CastError::MeanRelativeError() const {
  return measured == 0 ? 0.0 : relative_error_sum / static_cast<double>(measured);
}

std::string CastError::Describe() const {
  return absl::StrFormat(
      "%d elements: max relative error %.3g, mean %.3g%s; %d flushed to zero, %d overflowed, %d "
      "became subnormal",
      elements, max_relative_error, MeanRelativeError(),
      sampled() ? absl::StrFormat(" (of a sample of %d)", measured) : "", flushed_to_zero,
      overflowed, became_subnormal);
}

float RelativeErrorBound(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return 0x1p-8f;
    case DType::kFloat16:
      return 0x1p-11f;
    // Beside the code's rounding, an 8-bit cast rounds x / scale and the
    // code's value times the scale to fp32: a few fp32 ulps more.
    case DType::kFloat8E4M3FN:
      return 0x1.0001p-4f;
    case DType::kFloat8E5M2:
      return 0x1.0001p-3f;
    default:
      return 0;
  }
}

void MeasureCastError(const float* src, const uint16_t* out, size_t n, DType to, CastError* error) {
  static const MeasureKernel widest = KernelFor(SupportedCastIsas().back());
  widest(src, out, n, LimitsOf(to), error);
}

void MeasureCastError(const float* src, const uint16_t* out, size_t n, DType to, CastError* error,
                      CastIsa isa) {
  KernelFor(isa)(src, out, n, LimitsOf(to), error);
}

}  // namespace layercast
