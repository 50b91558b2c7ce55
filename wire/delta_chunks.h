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
// Which elements changed is coded in whichever form is smaller for the
// chunk: a bitmap (`changed`), 1/8 byte per element of the span whatever
// changed, or, when the reader accepts it, the gaps between the changed
// elements as LEB128 varints (`changed_gaps`), about 1 byte per changed
// element when a few percent change (a gap under 128 takes one byte, under
// 16384 two). The bitmap wins above about one change in 8-16 elements; an
// RL step at a small learning rate changes 1-5% of bf16 values, where the
// gaps cost a fifth to a tenth of the bitmap. Either way a delta is at most
// the changed values plus 1/8 byte per element, and applying it is one pass
// in element order.
struct DeltaSpan {
  uint32_t tensor = 0;
  uint64_t element_offset = 0;  // of the span's first element in the tensor
  uint64_t span_elements = 0;
  uint64_t version = 0;  // the values'
  uint64_t base_version = 0;
  // The reader takes changed_gaps (FetchLayerRequest.accepts_changed_gaps).
  bool gaps_allowed = false;
};

// An 8-bit float tensor's span also carries its block scales: every block
// the span touches (block element_offset / block_size and on), 4 bytes
// each, and which of them changed (one bit per block, as `changed`). Its
// codes are 1-byte elements. After an optimizer step nearly every block's
// absolute maximum, and so its scale, moves while few codes cross a
// rounding boundary: sending changed codes and scales apart keeps such a
// delta near the scales' 4 bytes per block, where whole changed blocks
// would resend almost the whole tensor.
struct DeltaScales {
  std::span<const uint8_t> values;    // 4 bytes per block
  std::span<const uint64_t> changed;  // bits past the blocks clear
};

// Serialises the delta chunk of `span`: `values` holds every element of the
// span in its compute dtype (span_elements * element_size bytes), `changed`
// its bitmap in 64-bit words (bit i % 64 of word i / 64; bits past the span
// clear); `scales` those of an 8-bit float span. The positions go as gaps
// when `span.gaps_allowed` and that is smaller, decided in the pass that
// packs the values (none over the span), for the elements and the scales
// apart. The slice holds a whole LayerChunk message, CRC-32C included.
grpc::Slice EncodeDeltaChunk(const DeltaSpan& span, std::span<const uint8_t> values,
                             size_t element_size, std::span<const uint64_t> changed,
                             const DeltaScales* scales = nullptr);

// Checks a received delta chunk against `span` (what was due: its tensor,
// offset, span and base) and writes its changed values into `destination`,
// which holds the span's elements, and an 8-bit float span's changed block
// scales into `scales` (every block the span touches, 4 bytes each; empty
// for other dtypes, whose chunks must carry none). DATA_LOSS, saying what
// was wrong, for a chunk whose bitmap, data size or checksum does not hold;
// nothing is written then. Either form of the positions. Returns the
// elements and block scales changed: a block whose scale alone moved
// changed the values of the layer as a code does, and a caller that asks
// whether anything changed (a mirror) must hear of it.
absl::StatusOr<uint64_t> ApplyDeltaChunk(const layercast::v1::LayerChunk& chunk,
                                         size_t element_size, std::span<uint8_t> destination,
                                         std::span<uint8_t> scales = {});

}  // namespace layercast::wire
