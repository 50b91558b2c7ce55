#pragma once

// Comparing two cast-error measurements in tests: a kernel's against the
// scalar definition's.

#include <string>

#include "absl/strings/str_cat.h"
#include "core/cast_error.h"

namespace layercast {

// What differs between `got` and `want`: every count and the maximum
// exactly, the sum of relative errors within `sum_tolerance` (kernels add in
// their own order); "" when nothing does.
inline std::string CastErrorDifference(const CastError& got, const CastError& want,
                                       double sum_tolerance) {
  std::string differences;
  auto count = [&](const char* name, uint64_t g, uint64_t w) {
    if (g != w) absl::StrAppend(&differences, name, " ", g, " (want ", w, ") ");
  };
  count("elements", got.elements, want.elements);
  count("measured", got.measured, want.measured);
  count("overflowed", got.overflowed, want.overflowed);
  count("flushed_to_zero", got.flushed_to_zero, want.flushed_to_zero);
  count("became_subnormal", got.became_subnormal, want.became_subnormal);
  for (int k = 0; k < CastError::kBuckets; ++k) {
    count(absl::StrCat("above[", k, "]").c_str(), got.above[k], want.above[k]);
  }
  if (got.max_relative_error != want.max_relative_error) {
    absl::StrAppend(&differences, "max_relative_error ", got.max_relative_error, " (want ",
                    want.max_relative_error, ") ");
  }
  const double sum_off = got.relative_error_sum - want.relative_error_sum;
  if (!(sum_off <= sum_tolerance && -sum_off <= sum_tolerance)) {
    absl::StrAppend(&differences, "relative_error_sum ", got.relative_error_sum, " (want ",
                    want.relative_error_sum, ", within ", sum_tolerance, ") ");
  }
  return differences;
}

}  // namespace layercast
