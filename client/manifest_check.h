#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layout.h"
#include "core/model.h"
#include "core/policy.h"
#include "layercast/v1/shard.pb.h"

namespace layercast::client {

// What a worker knows of a shard set once every manifest agrees: the model,
// the policy, and each layer's assembled layout, recomputed locally.
struct ShardSetView {
  ModelSpec model;
  Policy policy;
  std::vector<AssembledLayout> layouts;  // one per layer
  uint32_t num_shards = 0;
};

// Checks one manifest on its own: every field a worker relies on is
// consistent (shard index below the count, layer indices in order, shapes
// matching element counts, offsets and sizes equal to the layout the worker
// derives, the digest equal to the one it computes). Untrusted input: never
// crashes, allocates nothing beyond the manifest's own size.
absl::StatusOr<ShardSetView> CheckManifest(const layercast::v1::Manifest& manifest);

// Checks that the manifests of the shards at `addresses` (in shard order)
// form one set: the same model id, shard count (equal to addresses.size()),
// policy and layout digest, and shard i at position i, so each index appears
// exactly once. FAILED_PRECONDITION naming the shard that disagrees and how.
absl::StatusOr<ShardSetView> CheckShardSet(const std::vector<layercast::v1::Manifest>& manifests,
                                           const std::vector<std::string>& addresses);

}  // namespace layercast::client
