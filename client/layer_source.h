#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "client/cancellation.h"
#include "client/client_defaults.h"
#include "client/client_metrics.h"
#include "client/layer.h"
#include "client/pinned_identity.h"
#include "wire/manifest.h"

namespace layercast::client {

struct GatherOptions {
  // The whole gather, every shard's stream included, ends by then.
  std::chrono::milliseconds timeout = kLayerTimeout;
  // Wait on each shard until its parameter version reaches this.
  uint64_t min_version = 0;
  // A delta pull: the buffer holds the layer (or the byte range) at this
  // version already, and the shards send only the values that changed
  // since (FetchLayerRequest.base_version); the result is the same as a
  // full pull's. A shard that no longer holds the changes since then
  // answers OUT_OF_RANGE, and ShardSet pulls the layer in full instead
  // (and counts it: layercast_client_delta_fallbacks_total). An 8-bit
  // float tensor's delta brings the codes and block scales that changed.
  std::optional<uint64_t> base_version;
  // With base_version: per shard, the incarnation that served the base (as
  // `incarnations` of that gather gave it; empty or 0: unknown). A shard
  // that restarted since refuses the delta, since its version numbers may
  // name other values, and the layer is pulled in full.
  std::vector<uint64_t> base_incarnations;
  // With base_version: let the shards code which elements changed as gaps
  // where that is smaller than the bitmap (FetchLayerRequest.
  // accepts_changed_gaps; 10x smaller when 1% change). false asks for the
  // bitmap only, as workers before it did: for comparing the two.
  bool changed_gaps = true;
  // If set, filled once the gather succeeds: per shard, the incarnation
  // that served it (0 when the shard did not say), for the next delta's
  // base_incarnations.
  std::vector<uint64_t>* incarnations = nullptr;
  // A pinned read: the layer at exactly this version (waited for when the
  // shards are not there yet), as a walk of the whole model at one version
  // asks for every layer (FetchLayerRequest.exact_version). A shard whose
  // layer moved past it sends what it kept of it; one that kept nothing
  // answers ABORTED naming the version it is at, and the gather returns
  // that (it is not gathered again at another version).
  std::optional<uint64_t> exact_version;
  // With exact_version, for a walk of many layers at one version (a
  // LayerStream, an export): what the walk read, per shard, as an identity.
  // A shard that serves a later layer as another incarnation (it restarted,
  // and its number may name other values now) fails the gather with
  // ABORTED naming both: walk again from the first layer. Empty at the
  // walk's start; must outlive the gathers.
  PinnedIdentity* pinned_identity = nullptr;
  // The caller keeps the layer and will pull deltas of it
  // (FetchLayerRequest.will_pull_deltas): training shards record their
  // steps from now on, so the next delta is not refused. ModelMirror sets
  // it, and so does the full pull that replaces a refused delta.
  bool will_pull_deltas = false;
  // Only this byte range [first, second) of the assembled layout (for K local
  // GPUs each fetching 1/K); the rest of the buffer is left untouched.
  std::optional<std::pair<uint64_t, uint64_t>> byte_range;
  // Every tensor in this dtype rather than the policy's compute dtypes
  // (FetchLayerRequest.dtype), laid out as LayoutIn(layout, *dtype,
  // policy.fp8_block()) says: float32 reads the fp32 master (an export).
  // Shards serve no delta in it, so base_version is ignored, unless the
  // set is a relay that holds the layers in this dtype (Manifest.
  // held_dtype), which serves deltas in it.
  std::optional<DType> dtype;
  // If set, increased by the elements the gather wrote that may differ
  // from what the buffer held: all of a full pull's, a delta's changed
  // ones (0: the layer's values stayed as they were).
  uint64_t* changed_elements = nullptr;
  // If set and cancelled, the gather stops its streams and returns CANCELLED.
  Cancellation* cancellation = nullptr;
  // If set, called with the size of each chunk placed (for progress), on a
  // gRPC thread: it must be quick and thread-safe.
  std::function<void(uint64_t bytes)> on_chunk;
  // If set, told each time a shard's stream is retried: what it failed with
  // (naming the shard, e.g. "shard 1 (host:port): this shard is shutting
  // down ...") and how long until the retry. On the gathering thread, with
  // the gather's lock held: it must be quick, and must not cancel the
  // gather (cancel from another thread instead).
  std::function<void(const absl::Status& why, std::chrono::milliseconds delay)> on_retry;
};

// Where assembled layers come from: a ShardSet in production. The seam
// LayerStream is written against, so its concurrency can be tested (and run
// under ThreadSanitizer) without gRPC.
//
// Implementations are thread-safe.
class LayerSource {
 public:
  virtual ~LayerSource() = default;

  // The model, policy and every layer's assembled layout.
  virtual const wire::ShardSetView& view() const = 0;

  // Fills `buffer` (at least the layer's assembled bytes) with layer `layer`;
  // returns the parameter version it was cast from.
  virtual absl::StatusOr<uint64_t> GatherInto(uint32_t layer, const GatherOptions& options,
                                              std::span<uint8_t> buffer) const = 0;

  // Where to record the worker library's metrics; nullptr for none.
  virtual ClientMetrics* metrics() const = 0;

  // Wraps a filled buffer as layer `layer`. The Layer refers to view(), so
  // the source must outlive it.
  Layer MakeLayer(uint32_t layer, uint64_t version, LayerBuffer buffer) const {
    return Layer(layer, &view().model.layers[layer], &view().layouts[layer], version,
                 std::move(buffer));
  }
};

}  // namespace layercast::client
