#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "client/shard_set.h"
#include "core/cast_error.h"
#include "core/dtype.h"

namespace layercast::client {

// What the shards' casts of one layer to one dtype lost at one parameter
// version, every shard's slice added up (GetCastError on each shard).
struct LayerCastReport {
  uint32_t layer = 0;
  DType dtype = DType::kFloat32;
  uint64_t version = 0;
  uint32_t shards = 0;  // shards that cast part of the layer at that version
  uint64_t chunks = 0;
  CastError error;
};

// Asks every shard of `set` what its casts lost; by layer, dtype, then
// version (a layer the shards last cast at different versions has a row for
// each). Errors are the first failed call's, naming the shard.
absl::StatusOr<std::vector<LayerCastReport>> FetchCastErrorReport(
    const ShardSet& set, std::chrono::milliseconds timeout = std::chrono::seconds(10));

}  // namespace layercast::client
