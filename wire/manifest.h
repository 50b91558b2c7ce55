#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/content_fingerprint.h"
#include "core/layout.h"
#include "core/model.h"
#include "core/policy.h"
#include "layercast/v1/shard.pb.h"

namespace layercast::wire {

// The manifest is one contract with two halves, both here: a shard builds it
// (BuildManifest) and a worker checks it (CheckManifest, CheckShardSet), so a
// field added to one side is seen beside the other.

// What a shard says of itself in its manifest.
struct ManifestFacts {
  const ModelSpec* model = nullptr;
  const Policy* policy = nullptr;
  absl::Span<const AssembledLayout> layouts;  // one per layer of `model`
  uint32_t num_shards = 1;
  uint32_t shard_index = 0;
  std::array<uint8_t, 32> layout_digest{};
  ContentFingerprint content_fingerprint{};
  uint64_t incarnation = 0;
  // A training set's: 0 and empty on read-only shards.
  uint32_t data_parallel_workers = 0;
  std::string optimizer;
  uint64_t chunk_bytes = 0;  // the shard's --chunk-bytes
};

// The manifest a shard serves: every tensor's shape, dtypes, offset and
// size in the assembled layer, as CheckManifest recomputes them.
layercast::v1::Manifest BuildManifest(const ManifestFacts& facts);

// The most layers a manifest may list. The deepest models have a few hundred;
// the cap bounds what a forged manifest makes a worker hold (a LayerSpec and a
// layout per layer) before anything else about it is known to be true.
inline constexpr uint64_t kMaxManifestLayers = uint64_t{1} << 16;

// The most tensors a manifest may list, all layers together. The largest
// mixture-of-experts checkpoints hold around a hundred thousand; the cap
// bounds the worker's copy of the model the same way.
inline constexpr uint64_t kMaxManifestTensors = uint64_t{1} << 20;

// What a worker knows of a shard set once every manifest agrees: the model,
// the policy, and each layer's assembled layout, recomputed locally.
struct ShardSetView {
  ModelSpec model;
  Policy policy;
  std::vector<AssembledLayout> layouts;  // one per layer
  // One per layer: GradientLayout(layouts[l]), the shape a worker pushes
  // layer l's gradient in (layouts[l] unless it has 8-bit float tensors).
  std::vector<AssembledLayout> gradient_layouts;
  uint32_t num_shards = 0;
};

// Checks one manifest on its own: every field a worker relies on is
// consistent (shard index below the count, layer indices in order, shapes
// matching element counts, offsets and sizes equal to the layout the worker
// derives, the digest equal to the one it computes), and within the caps: at
// most kMaxManifestLayers layers and kMaxManifestTensors tensors, no layer
// over kMaxAssembledLayerBytes (checked before the worker allocates any layer
// buffer). FAILED_PRECONDITION "inconsistent manifest: ..." naming the figure
// and what it should be. Untrusted input: never crashes, allocates nothing
// beyond the manifest's own size.
absl::StatusOr<ShardSetView> CheckManifest(const layercast::v1::Manifest& manifest);

// Checks that the manifests of the shards at `addresses` (in shard order)
// form one set: the same model id, shard count (equal to addresses.size()),
// policy and layout digest, and shard i at position i, so each index appears
// exactly once. FAILED_PRECONDITION naming the shard that disagrees and how.
absl::StatusOr<ShardSetView> CheckShardSet(const std::vector<layercast::v1::Manifest>& manifests,
                                           const std::vector<std::string>& addresses);

}  // namespace layercast::wire
