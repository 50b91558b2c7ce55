#include "wire/cast_error_report.h"

#include <algorithm>

namespace layercast::wire {

void CastErrorToProto(const CastError& error, layercast::v1::LayerCastError* out) {
  out->set_elements(error.elements);
  out->set_overflowed(error.overflowed);
  out->set_flushed_to_zero(error.flushed_to_zero);
  out->set_became_subnormal(error.became_subnormal);
  out->set_measured(error.measured);
  out->set_unmeasured(error.unmeasured);
  out->set_max_relative_error(error.max_relative_error);
  out->set_relative_error_sum(error.relative_error_sum);
  out->clear_above();
  for (uint64_t above : error.above) out->add_above(above);
}

CastError CastErrorFromProto(const layercast::v1::LayerCastError& row) {
  CastError error;
  error.elements = row.elements();
  error.overflowed = row.overflowed();
  error.flushed_to_zero = row.flushed_to_zero();
  error.became_subnormal = row.became_subnormal();
  error.measured = row.measured();
  error.unmeasured = row.unmeasured();
  error.max_relative_error = row.max_relative_error();
  error.relative_error_sum = row.relative_error_sum();
  const int kept = std::min(row.above_size(), CastError::kBuckets);
  for (int k = 0; k < kept; ++k) error.above[k] = row.above(k);
  return error;
}

}  // namespace layercast::wire
