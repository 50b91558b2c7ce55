#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "server/shard/shard_config.h"

namespace layercast::server {

// What `layercast-shard --dry-run` finds: a report for people, and whether
// --memory-budget (if given) holds every shard.
struct DryRunReport {
  std::string text;
  bool fits = true;
};

// Reads the model's headers (never its data) and says what every shard of
// it needs in memory under `settings` (all --num-shards of them, whatever
// --shard-index says): the fp32 master, optimizer state and step staging
// when training, one stream's buffers; the least --memory-budget each
// starts with, and the container memory to give it. The arithmetic is the
// start-up check's (memory_plan.h), so a budget the report accepts starts.
absl::StatusOr<DryRunReport> DryRun(const ShardSettings& settings);

// The memory the base StatefulSet leaves a container above memory_budget
// (its layercast/memory-headroom annotation): code, gRPC, allocator slack.
inline constexpr uint64_t kContainerHeadroomBytes = 512ull << 20;

}  // namespace layercast::server
