#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "core/synthetic_model.h"
#include "server/shard/memory_plan.h"
#include "server/shard/shard_config.h"

namespace layercast::server {

// What a server of `config` as one shard of one (a synthetic model,
// --delta-versions 0) holds beside its streams' chunk buffers: what its
// memory plan reserves at start-up (the fp32 master and the cast-error
// ledger, with no optimizer and no change bitmaps). A test that leaves a
// budget room for so many chunks adds them to this.
inline uint64_t BytesBesideStreams(layercast::v1::ShardConfig config) {
  config.set_num_shards(1);
  const absl::StatusOr<ShardSettings> settings = ResolveShardConfig(config);
  auto source = SyntheticModel::Create(config.synthetic());
  if (!settings.ok() || !source.ok()) {
    ADD_FAILURE() << "no plan for " << config.synthetic() << ": "
                  << (settings.ok() ? source.status() : settings.status());
    return 0;
  }
  const absl::StatusOr<MemoryPlan> plan =
      PlanShardMemory((*source)->model(), settings->policy, 0, 1, settings->config.chunk_bytes(),
                      /*delta_versions=*/0, std::nullopt);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? plan->ReservedBytes() : 0;
}

}  // namespace layercast::server
