#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layout.h"
#include "layercast/v1/shard.pb.h"
#include "server/parameter_store.h"

namespace layercast::server {

// What one FetchLayer stream sends: for each tensor it touches, the run of
// owned elements to cast and stream, in tensor order.
struct FetchPlan {
  uint32_t layer = 0;
  std::vector<TensorElementRange> runs;  // absolute element ranges, never empty
  uint64_t bytes = 0;                    // total bytes to send (SentBytes)
};

// Bytes that sending `elements` of `tensor` takes: the values in the
// compute dtype, and for an 8-bit float the scale of every block they touch.
uint64_t SentBytes(const AssembledTensor& tensor, ElementRange elements);

// Validates `request` against the store and plans the stream. Does no work
// and allocates nothing sized by the request before validation passes.
//   NOT_FOUND            no such layer;
//   INVALID_ARGUMENT     byte range outside the layer, reversed, half given,
//                        or not on element boundaries;
//   FAILED_PRECONDITION  expect_dtype differs from the policy's dtype of a
//                        tensor in the layer;
//   OUT_OF_RANGE         a delta pull (base_version) of a layer with an
//                        8-bit float tensor: pull it in full.
// Every message says what is valid.
absl::StatusOr<FetchPlan> PlanFetch(const ParameterStore& store,
                                    const layercast::v1::FetchLayerRequest& request);

}  // namespace layercast::server
