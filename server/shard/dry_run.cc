#include "server/shard/dry_run.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/layout.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "server/casting/cast_cache.h"
#include "server/shard/memory_plan.h"
#include "server/shard/model_source.h"

namespace layercast::server {
namespace {

// "68.98 G", "17.04 M", "4.10 k" or "950": a tiny synthetic model does not
// read as "0.00 G".
std::string ParameterCount(uint64_t count) {
  const double n = static_cast<double>(count);
  if (n >= 1e9) return absl::StrFormat("%.2f G", n / 1e9);
  if (n >= 1e6) return absl::StrFormat("%.2f M", n / 1e6);
  if (n >= 1e3) return absl::StrFormat("%.2f k", n / 1e3);
  return absl::StrCat(count);
}

// How the tensors were grouped into layers (by --layer-regex): each layer's
// name and tensor count, the middle of a long model elided.
std::string LayerGrouping(const ModelSpec& model) {
  std::vector<std::string> shown;
  const size_t n = model.layers.size();
  for (size_t l = 0; l < n; ++l) {
    if (n > 6 && l == 3) {
      shown.push_back(absl::StrCat("... (", n - 5, " more)"));
      l = n - 3;
      continue;
    }
    const size_t tensors = model.layers[l].tensors.size();
    shown.push_back(
        absl::StrCat(model.layers[l].name, " (", tensors, tensors == 1 ? " tensor)" : " tensors)"));
  }
  return absl::StrJoin(shown, ", ");
}

// What --cast-cache-bytes would hold of shard `plan.shard_index`'s layers
// after a walk through the model, each admitted as the cache admits it
// (CastCache::Admits) beside the plan's reserved bytes and the one stream
// reading it.
std::string CastCacheLine(const std::vector<AssembledLayout>& layouts, const MemoryPlan& plan,
                          uint64_t capacity, std::optional<uint64_t> budget) {
  uint64_t held = 0, all = 0;
  size_t kept = 0, keepable = 0;
  for (const AssembledLayout& layout : layouts) {
    const uint64_t bytes = CastCache::LayerBytes(layout, plan.shard_index, plan.num_shards);
    all += bytes;
    keepable += bytes > 0;
    if (CastCache::Admits(held, bytes, capacity, budget, plan.MinimumBudget() + held)) {
      held += bytes;
      ++kept;
    }
  }
  return absl::StrCat("  shard ", plan.shard_index, "/", plan.num_shards, ": ", kept, " of ",
                      keepable, " layers, ", FormatBytes(held), " of the ", FormatBytes(all),
                      " its layers take\n");
}

}  // namespace

absl::StatusOr<DryRunReport> DryRun(const ShardSettings& settings) {
  const auto& config = settings.config;
  ASSIGN_OR_RETURN(std::unique_ptr<ParameterSource> source, OpenSource(settings));
  const ModelSpec& model = source->model();
  if (model.layers.empty()) {  // as the shard itself refuses it
    return absl::InvalidArgumentError(absl::StrCat("model ", model.model_id, " has no layers"));
  }
  std::optional<TrainingPlan> training;
  if (settings.optimizer) {
    training = TrainingPlan{*settings.optimizer, config.data_parallel_workers()};
  }

  DryRunReport report;
  absl::StrAppend(
      &report.text, "model ", model.model_id, ": ", model.layers.size(), " layers, ",
      ParameterCount(TotalElements(model)), " parameters, on ", config.num_shards(),
      config.num_shards() == 1 ? " shard" : " shards", "; policy ", settings.policy.ToString(),
      "; ",
      training ? absl::StrCat("training with ", OptimizerKindName(training->optimizer.kind()), ", ",
                              training->workers, " data-parallel workers")
               : "read-only",
      "\n");
  absl::StrAppend(&report.text, "layers: ", LayerGrouping(model), "\n");
  absl::StrAppend(&report.text, absl::StrFormat("%-8s %14s %16s %14s %14s %14s %14s %22s\n",
                                                "shard", "fp32 master", "optimizer state",
                                                "step staging", "stream buffers", "change bitmaps",
                                                "cast ledger", "least --memory-budget"));
  uint64_t most = 0;
  std::string refusal, cast_cache;
  std::vector<AssembledLayout> layouts;
  if (config.cast_cache_bytes() > 0) {
    ASSIGN_OR_RETURN(layouts, ShardedLayouts(model, settings.policy, config.num_shards()));
  }
  for (uint32_t shard = 0; shard < config.num_shards(); ++shard) {
    // A policy the model's tensors cannot take (an 8-bit float block that
    // two shards would split) stops the shard as it plans: so it does here.
    ASSIGN_OR_RETURN(const MemoryPlan plan,
                     PlanShardMemory(model, settings.policy, shard, config.num_shards(),
                                     config.chunk_bytes(), config.delta_versions(), training));
    most = std::max(most, plan.MinimumBudget());
    if (config.cast_cache_bytes() > 0) {
      absl::StrAppend(&cast_cache, CastCacheLine(layouts, plan, config.cast_cache_bytes(),
                                                 settings.memory_budget_bytes));
    }
    absl::StrAppend(&report.text,
                    absl::StrFormat("%-8s %14s %16s %14s %14s %14s %14s %22s\n",
                                    absl::StrCat(shard, "/", config.num_shards()),
                                    FormatBytes(plan.master_bytes), FormatBytes(plan.state_bytes),
                                    FormatBytes(plan.staging_bytes), FormatBytes(plan.stream_bytes),
                                    FormatBytes(plan.change_bytes), FormatBytes(plan.ledger_bytes),
                                    FormatBytes(plan.MinimumBudget())));
    if (settings.memory_budget_bytes && refusal.empty()) {
      if (absl::Status fits = CheckPlanFits(plan, training, *settings.memory_budget_bytes);
          !fits.ok()) {
        refusal = std::string(fits.message());
      }
    }
  }
  if (!cast_cache.empty()) {
    absl::StrAppend(&report.text, "cast cache (--cast-cache-bytes ",
                    FormatBytes(config.cast_cache_bytes()),
                    "; a shard's RSS grows by what it holds; 8-bit float tensors are not kept), "
                    "after one walk by one reader",
                    settings.memory_budget_bytes ? " in --memory-budget" : "", ":\n", cast_cache);
  }
  // Whole MiB, rounded up: the Kubernetes quantity a manifest can carry.
  const auto mebibytes = [](uint64_t bytes) { return (bytes + (1 << 20) - 1) >> 20; };
  absl::StrAppend(&report.text, "every shard starts with --memory-budget ", mebibytes(most),
                  "Mi or more (memory_budget in a config file); give its container that plus ",
                  mebibytes(kContainerHeadroomBytes),
                  "Mi of headroom (the base StatefulSet's layercast/memory-headroom): a memory "
                  "request and limit of ",
                  mebibytes(most) + mebibytes(kContainerHeadroomBytes), "Mi\n");
  if (settings.memory_budget_bytes) {
    report.fits = refusal.empty();
    absl::StrAppend(
        &report.text, "--memory-budget ", FormatBytes(*settings.memory_budget_bytes),
        report.fits ? ": every shard fits\n" : absl::StrCat(": too small: ", refusal, "\n"));
  }
  return report;
}

}  // namespace layercast::server
