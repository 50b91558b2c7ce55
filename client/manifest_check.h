#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layout.h"
#include "core/model.h"
#include "core/policy.h"
#include "layercast/v1/shard.pb.h"

namespace layercast::client {

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

}  // namespace layercast::client
