#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/cast.h"
#include "core/layer_grouping.h"
#include "core/optimizer_spec.h"
#include "core/policy.h"
#include "layercast/v1/config.pb.h"
#include "platform/clock.h"
#include "platform/log.h"
#include "server/training/push_journal.h"

namespace layercast::server {

// Builds a ShardConfig from command-line arguments (without argv[0]):
// `--config FILE` (JSON, proto3 mapping) is read first, then every
// `--field-name VALUE` or `--field-name=VALUE` sets the ShardConfig field of
// that name ('-' for '_'), overriding the file. INVALID_ARGUMENT naming the
// unknown flag, the missing value or the bad JSON.
absl::StatusOr<layercast::v1::ShardConfig> ParseShardFlags(const std::vector<std::string>& args);

// One line per flag, for --help.
std::string ShardFlagsHelp();

// A validated configuration with defaults applied and strings parsed.
struct ShardSettings {
  layercast::v1::ShardConfig config;
  Policy policy;
  LayerGroupingRule grouping;
  std::optional<uint64_t> memory_budget_bytes;  // nullopt: unlimited
  LogFormat log_format = LogFormat::kText;
  spdlog::level::level_enum log_level = spdlog::level::info;
  std::optional<OptimizerSpec> optimizer;  // nullopt: read-only
  std::optional<CastIsa> cast_isa;         // nullopt: measured (BestCastIsa)
  // --journal-sync, parsed (config.journal_sync_interval_ms is its interval).
  PushJournal::Sync journal_sync = PushJournal::Sync::kNone;
  // What the shard's timers read (deadlines, retentions, the stall sweep,
  // publish timeouts); null: the steady clock. Tests in one process pass a
  // ManualClock, which must outlive the server.
  platform::Clock* clock = nullptr;
};

// Applies defaults and checks everything that can be checked without
// touching the model or other files: shard index < count, exactly one model
// source, the policy (params must be float32), chunk size, budget syntax,
// the limits' ranges; checkpoint_on_sigterm defaults to whether
// checkpoint_dir is set. The message names the field and what is valid.
// (TLS files, the admin token and the checkpoint are read by
// ShardServer::Create.)
absl::StatusOr<ShardSettings> ResolveShardConfig(layercast::v1::ShardConfig config);

}  // namespace layercast::server
