#include "server/shard/memory_plan.h"

#include "absl/numeric/int128.h"
#include "absl/strings/str_cat.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "server/casting/cast_error_ledger.h"
#include "server/serving/change_log.h"
#include "server/serving/fetch_plan.h"
#include "server/serving/parameter_store.h"
#include "server/training/layer_trainer.h"

namespace layercast::server {

namespace {

uint64_t Saturated(absl::uint128 sum) {
  return sum > UINT64_MAX ? UINT64_MAX : absl::Uint128Low64(sum);
}

}  // namespace

uint64_t MemoryPlan::ReservedBytes() const {
  return Saturated(absl::uint128(master_bytes) + state_bytes + change_bytes + ledger_bytes);
}

uint64_t MemoryPlan::MinimumBudget() const {
  return Saturated(absl::uint128(ReservedBytes()) + staging_bytes + stream_bytes);
}

absl::StatusOr<MemoryPlan> PlanShardMemory(const ModelSpec& model, const Policy& policy,
                                           uint32_t shard_index, uint32_t num_shards,
                                           uint64_t chunk_bytes, uint32_t delta_versions,
                                           const std::optional<TrainingPlan>& training) {
  MemoryPlan plan;
  plan.shard_index = shard_index;
  plan.num_shards = num_shards;
  ASSIGN_OR_RETURN(plan.master_bytes, ParameterStore::MasterBytes(model, shard_index, num_shards));
  plan.stream_bytes = MaxStreamBufferBytes(chunk_bytes, delta_versions > 0);
  plan.change_bytes = ChangeLog::BytesFor(model, shard_index, num_shards, delta_versions);
  ASSIGN_OR_RETURN(const std::vector<AssembledLayout> layouts,
                   ShardedLayouts(model, policy, num_shards));
  plan.layers = static_cast<uint32_t>(model.layers.size());
  plan.grid_chunks = GridChunks(layouts, shard_index, num_shards, chunk_bytes);
  plan.ledger_bytes = CastErrorLedger::BytesFor(plan.grid_chunks, plan.layers);
  if (training) {
    const LayerTrainer::Memory memory = LayerTrainer::MemoryFor(
        model, shard_index, num_shards, training->optimizer, training->workers);
    plan.state_bytes = memory.state_bytes;
    plan.staging_bytes = memory.step_staging_bytes;
  }
  return plan;
}

absl::Status CheckPlanFits(const MemoryPlan& plan, const std::optional<TrainingPlan>& training,
                           uint64_t budget) {
  const std::string shard = absl::StrCat("shard ", plan.shard_index, " of ", plan.num_shards);
  if (plan.master_bytes > budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        shard, " needs ", FormatBytes(plan.master_bytes), " (", plan.master_bytes,
        " bytes) for its fp32 master parameters, but --memory-budget is ", FormatBytes(budget),
        " (", budget, " bytes): raise the budget or use more shards"));
  }
  if (training && plan.MinimumBudget() > budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        shard, " cannot train in --memory-budget ", FormatBytes(budget), ": it needs ",
        FormatBytes(plan.master_bytes), " of fp32 master + ", FormatBytes(plan.state_bytes), " of ",
        OptimizerKindName(training->optimizer.kind()), " state + ", FormatBytes(plan.staging_bytes),
        " to stage one step of its largest layer (", training->workers,
        " workers' pushes in fp32) + ", FormatBytes(plan.stream_bytes),
        " for one stream's chunks + ", FormatBytes(plan.change_bytes),
        " of change bitmaps (--delta-versions) + ", FormatBytes(plan.ledger_bytes),
        " of cast-error ledger (a record per chunk of --chunk-bytes): raise the budget or use more "
        "shards",
        plan.ledger_bytes > plan.stream_bytes ? ", or raise --chunk-bytes (fewer, larger chunks)"
                                              : ""));
  }
  if (absl::uint128(budget - plan.master_bytes) <
      absl::uint128(plan.change_bytes) + plan.stream_bytes + plan.ledger_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "--memory-budget of ", FormatBytes(budget), " leaves ",
        FormatBytes(budget - plan.master_bytes), " beside ", shard, "'s fp32 master of ",
        FormatBytes(plan.master_bytes), ", but it needs ", FormatBytes(plan.stream_bytes),
        " for one stream",
        plan.change_bytes > 0 ? " (two chunks of --chunk-bytes, with a delta's bitmap), "
                              : " (twice --chunk-bytes), ",
        plan.change_bytes > 0 ? absl::StrCat(FormatBytes(plan.change_bytes),
                                             " of change bitmaps (--delta-versions), ")
                              : "",
        "and ", FormatBytes(plan.ledger_bytes), " for the cast-error ledger (a record for each of ",
        plan.grid_chunks, " chunks of --chunk-bytes): raise the budget or ",
        plan.ledger_bytes > plan.stream_bytes ? "--chunk-bytes (fewer, larger chunks)"
                                              : "lower --chunk-bytes",
        plan.change_bytes > 0 ? ", or lower --delta-versions" : "", ", or use more shards"));
  }
  return absl::OkStatus();
}

}  // namespace layercast::server
