#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layout.h"
#include "layercast/v1/shard.pb.h"
#include "server/serving/change_log.h"
#include "server/serving/parameter_store.h"

namespace layercast::server {

// What one FetchLayer stream sends: for each tensor it touches, the run of
// owned elements to cast and stream, in tensor order.
struct FetchPlan {
  uint32_t layer = 0;
  // The layout the stream sends in: the store's, or every tensor in the
  // request's dtype.
  AssembledLayout layout;
  // Set when the request named a dtype other than the policy's
  // (FetchLayerRequest.dtype): the stream casts its own chunks.
  std::optional<DType> dtype;
  // Whether what the shard keeps of superseded versions (and its record of
  // which values changed, both in the policy's KeptDType bits) holds what
  // this stream sends: always, unless `dtype` is one they cannot give.
  bool kept_bits_serve = true;
  std::vector<TensorElementRange> runs;  // absolute element ranges, never empty
  uint64_t bytes = 0;                    // total bytes to send (SentBytes)
};

// Bytes that sending `elements` of `tensor` takes: the values in the
// compute dtype, and for an 8-bit float the scale of every block they touch.
uint64_t SentBytes(const AssembledTensor& tensor, ElementRange elements);

// Elements in one chunk of `tensor`: as many as fit in `chunk_bytes`. An
// 8-bit float's chunks hold whole blocks, so a chunk on the grid is
// quantized and measured block by block in one pass, and each block brings
// its fp32 scale, plus the two more StreamBufferBytes counts
// for a chunk off the block grid (which touches one block more): those
// count too, so a stream holds no more than MaxStreamBufferBytes says (from
// LeastFp8ChunkBytes, the least chunk_bytes ResolveShardConfig accepts).
uint64_t ElementsPerChunk(uint64_t chunk_bytes, const AssembledTensor& tensor);

// The chunks a shard cuts its slice of one tensor into: ElementsPerChunk
// steps from the slice's first element, the last one shorter. Every stream
// casts on this grid, wherever its range starts, so a resumed or ranged
// stream meets the chunks other streams have cast, and these are all the
// chunks a shard keeps anything of (its cast-error ledger).
class ChunkGrid {
 public:
  ChunkGrid(uint64_t chunk_bytes, const AssembledTensor& tensor, ElementRange owned)
      : owned_(owned), per_chunk_(ElementsPerChunk(chunk_bytes, tensor)) {}

  // How many chunks the slice cuts into.
  uint64_t chunks() const { return owned_.size() / per_chunk_ + (owned_.size() % per_chunk_ != 0); }
  // Where the chunk holding `element` ends, within the slice.
  // REQUIRES: `element` is in the slice.
  uint64_t ChunkEnd(uint64_t element) const {
    return std::min(owned_.end,
                    owned_.begin + ((element - owned_.begin) / per_chunk_ + 1) * per_chunk_);
  }
  // Whether `elements` is one whole chunk of the grid.
  bool IsChunk(ElementRange elements) const {
    return elements.begin >= owned_.begin && elements.begin < owned_.end &&
           (elements.begin - owned_.begin) % per_chunk_ == 0 &&
           elements.end == ChunkEnd(elements.begin);
  }

 private:
  ElementRange owned_;
  uint64_t per_chunk_;
};

// The chunks of the grid shard `shard_index` of `num_shards` cuts its
// slices of `layouts` (every layer's) into at `chunk_bytes`: each tensor's
// ChunkGrid. Saturates at UINT64_MAX.
uint64_t GridChunks(const std::vector<AssembledLayout>& layouts, uint32_t shard_index,
                    uint32_t num_shards, uint64_t chunk_bytes);

// What a delta chunk of `elements` values (and `blocks` block scales, for
// an 8-bit float) holds beside them: their bitmaps and a header (tags,
// varints and the CRC).
uint64_t DeltaExtraBytes(uint64_t elements, uint64_t blocks);

// Whether a delta pays against the values it replaces, for a shard and a
// relay alike: each changed value and a bitmap bit per element, against
// every value. Most values changed, a delta is larger, and the reader
// should pull in full.
class DeltaCost {
 public:
  // `changed` of `elements` values of `size` bytes each.
  void Add(uint64_t changed, uint64_t elements, size_t size);
  // OUT_OF_RANGE ("pull the layer in full") naming the figures when the
  // delta would be larger; `what` says what sends it (e.g. "this shard").
  absl::Status Check(uint32_t layer, uint64_t base_version, absl::string_view what) const;

 private:
  uint64_t changed_ = 0, elements_ = 0, delta_bytes_ = 0, full_bytes_ = 0;
};

// Budgeted bytes one stream of `plan` holds while it runs: its largest
// chunk, twice, since the transport may still hold the previous chunk's
// slice when the next one is cast. A delta chunk may hold its whole span's
// values, its bitmap and its header.
uint64_t StreamBufferBytes(const FetchPlan& plan, uint64_t chunk_bytes, bool delta = false);

// The most StreamBufferBytes gives for any plan with `chunk_bytes` of at
// least LeastFp8ChunkBytes (server/shard/memory_plan.h) under 8-bit floats: two
// chunks of values (an 8-bit float's with its scales), and with `deltas`
// (the shard keeps changes, so any stream may be a delta) a delta chunk's
// bitmap and header. The memory plan counts one stream as this.
uint64_t MaxStreamBufferBytes(uint64_t chunk_bytes, bool deltas);

// Validates `request` against the store and plans the stream. Does no work
// and allocates nothing sized by the request before validation passes.
//   NOT_FOUND            no such layer;
//   INVALID_ARGUMENT     byte range outside the layer, reversed, half given,
//                        or not on element boundaries;
//   FAILED_PRECONDITION  expect_dtype differs from the policy's dtype of a
//                        tensor in the layer, or an 8-bit dtype's blocks
//                        would straddle two shards' slices;
//   OUT_OF_RANGE         a delta pull (base_version) of a layer with an
//                        8-bit float tensor, or in a dtype of its own:
//                        pull it in full.
// Every message says what is valid.
absl::StatusOr<FetchPlan> PlanFetch(const ParameterStore& store,
                                    const layercast::v1::FetchLayerRequest& request);

// What PlanFetch checks a request against: a shard's store, or a relay's
// copy of what the shard told it (relay/).
struct FetchFacts {
  const ModelSpec* model = nullptr;
  const Policy* policy = nullptr;
  absl::Span<const AssembledLayout> layouts;  // one per layer of `model`
  ContentFingerprint content_fingerprint{};
  uint32_t shard_index = 0;
  uint32_t num_shards = 1;
  // Of the shard that serves the layer (a delta's base must name it).
  uint64_t incarnation = 0;
};
absl::StatusOr<FetchPlan> PlanFetch(const FetchFacts& facts,
                                    const layercast::v1::FetchLayerRequest& request);

// What a stream of `request` waits for before it sends: the version it
// asks for (its exact_version when pinned, else its min_version), and
// whether that is past `current` (the layer's version now), so the stream
// parks: it holds no budget, and a slot of its own kind.
struct FetchWait {
  uint64_t version = 0;
  bool parked = false;
};

// Validates `request`'s versions against the layer's `current` one:
//   INVALID_ARGUMENT  min_version or base_version above exact_version;
//   OUT_OF_RANGE      a version more than `max_version_lead` ahead (it
//                     cannot come soon), or a delta from a shard that keeps
//                     no changes (`keeps_changes` false).
// Every message says what to ask for instead.
absl::StatusOr<FetchWait> PlanWait(const layercast::v1::FetchLayerRequest& request,
                                   uint64_t current, uint32_t max_version_lead, bool keeps_changes);

}  // namespace layercast::server
