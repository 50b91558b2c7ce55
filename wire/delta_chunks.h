#pragma once

#include <cstdint>
#include <span>

#include <grpcpp/support/slice.h>

#include "absl/status/statusor.h"
#include "layercast/v1/shard.pb.h"

namespace layercast::wire {

// A delta LayerChunk (shard.proto: a FetchLayer with base_version): which
// elements of a span of one tensor changed since the base, as a bitmap of
// one bit per element, and the new values of those elements, packed.
//
// Why a bitmap: it costs 1/8 byte per element of the span whatever
// changed, so a delta is at most the changed values plus 1/8 byte per
// element (1/16 of a bfloat16 layer), and applying it is one pass in
// element order. A list of indices would be smaller only below one change
// in 16 elements (bench/delta_bench measures what changes after real
// optimizer steps).
struct DeltaSpan {
  uint32_t tensor = 0;
  uint64_t element_offset = 0;  // of the span's first element in the tensor
  uint64_t span_elements = 0;
  uint64_t version = 0;  // the values'
  uint64_t base_version = 0;
};

// Serialises the delta chunk of `span`: `values` holds every element of the
// span in its compute dtype (span_elements * element_size bytes), `changed`
// its bitmap in 64-bit words (bit i % 64 of word i / 64; bits past the span
// clear). The slice holds a whole LayerChunk message, CRC-32C included.
grpc::Slice EncodeDeltaChunk(const DeltaSpan& span, std::span<const uint8_t> values,
                             size_t element_size, std::span<const uint64_t> changed);

// Checks a received delta chunk against `span` (what was due: its tensor,
// offset, span and base) and writes its changed values into `destination`,
// which holds the span's elements. DATA_LOSS, saying what was wrong, for a
// chunk whose bitmap, data size or checksum does not hold; nothing is
// written then. Returns the elements changed.
absl::StatusOr<uint64_t> ApplyDeltaChunk(const layercast::v1::LayerChunk& chunk,
                                         size_t element_size, std::span<uint8_t> destination);

}  // namespace layercast::wire
