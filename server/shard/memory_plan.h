#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/optimizer_spec.h"
#include "core/policy.h"

namespace layercast::server {

// The least --chunk-bytes under a policy with 8-bit floats in blocks of
// `fp8_block`: one block of codes and the three scales a chunk may bring
// (its block's, and one more for each end of a chunk that starts or ends
// inside a block). From there a stream holds no more than the plan's
// stream_bytes (MaxStreamBufferBytes); ResolveShardConfig
// refuses less.
constexpr uint64_t LeastFp8ChunkBytes(uint32_t fp8_block) { return fp8_block + 3 * sizeof(float); }

// What one shard of a model needs in memory, known from the model's shapes
// alone (headers, not data): the arithmetic of the shard's start-up check,
// which `layercast-shard --dry-run` prints before anyone deploys.
struct MemoryPlan {
  uint32_t shard_index = 0;
  uint32_t num_shards = 0;
  uint64_t master_bytes = 0;   // the fp32 master of this shard's slices
  uint64_t state_bytes = 0;    // optimizer state (training shards)
  uint64_t staging_bytes = 0;  // one step of the largest layer, W pushes (+ clip means)
  uint64_t stream_bytes = 0;   // one stream's chunks: MaxStreamBufferBytes
  uint64_t change_bytes = 0;   // --delta-versions of change bitmaps (server/serving/change_log.h)
  uint32_t layers = 0;         // the model's layers
  uint64_t grid_chunks = 0;    // chunks of the shard's grid (GridChunks)
  uint64_t ledger_bytes = 0;   // what the casts lost, a record per grid chunk (CastErrorLedger)
  // What the shard reserves from its budget at start-up and holds while it
  // runs: the master, optimizer state, change bitmaps and the ledger.
  // Saturates at UINT64_MAX.
  uint64_t ReservedBytes() const;
  // The least --memory-budget the shard starts with: the reserved bytes, a
  // step's staging and one stream. Saturates at UINT64_MAX.
  uint64_t MinimumBudget() const;
};

// Training: the optimizer and the data-parallel workers; nullopt for a
// read-only shard.
struct TrainingPlan {
  OptimizerSpec optimizer;
  uint32_t workers = 1;
};

// INVALID_ARGUMENT when the master of the shard's slices overflows; the
// errors of ShardedLayouts when `policy` cannot lay the model out.
absl::StatusOr<MemoryPlan> PlanShardMemory(const ModelSpec& model, const Policy& policy,
                                           uint32_t shard_index, uint32_t num_shards,
                                           uint64_t chunk_bytes, uint32_t delta_versions,
                                           const std::optional<TrainingPlan>& training);

// RESOURCE_EXHAUSTED, with the arithmetic and what to change, when `plan`
// does not fit `budget`.
absl::Status CheckPlanFits(const MemoryPlan& plan, const std::optional<TrainingPlan>& training,
                           uint64_t budget);

}  // namespace layercast::server
