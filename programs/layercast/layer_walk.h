#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "client/layer_stream.h"
#include "client/shard_set.h"

namespace layercast::cli {

// What a walk over layers moved and how fast.
struct WalkStats {
  uint32_t layers = 0;              // gathers done
  uint64_t wire_bytes = 0;          // tensor bytes received, in compute dtypes
  uint64_t fp32_bytes = 0;          // what gathering the same tensors in fp32 would move
  double seconds = 0;               // wall time of the whole walk
  client::LayerStreamStats stream;  // waiting, prefetch hits, peak bytes held
};

// Walks `order` through a prefetching LayerStream holding at most
// `budget_bytes` of layers: calls `use` on each layer, drops it, and prints a
// progress line to stderr (redrawn in place on a terminal). `label(step)`
// names the phase of step `step`, e.g. "forward".
absl::StatusOr<WalkStats> WalkLayers(const client::ShardSet& set,
                                     const std::vector<uint32_t>& order, uint64_t budget_bytes,
                                     const std::function<const char*(size_t step)>& label,
                                     const std::function<absl::Status(const client::Layer&)>& use);

// A budget of `layers` times the model's largest assembled layer.
uint64_t LayersBudget(const client::ShardSet& set, uint64_t layers);

}  // namespace layercast::cli
