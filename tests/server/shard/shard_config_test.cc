#include "server/shard/shard_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "platform/status_macros.h"

namespace layercast::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

absl::StatusOr<ShardSettings> Resolve(std::vector<std::string> flags) {
  std::vector<std::string> args = {"--num-shards", "1", "--synthetic", "llama:layers=1"};
  args.insert(args.end(), flags.begin(), flags.end());
  ASSIGN_OR_RETURN(layercast::v1::ShardConfig config, ParseShardFlags(args));
  return ResolveShardConfig(std::move(config));
}

// Checked before gRPC sees them: gRPC would bind 99999 modulo 65536.
TEST(ShardConfigTest, ListenAddressesAreHostColonPort) {
  for (const char* good : {"127.0.0.1:0", "0.0.0.0:7070", "[::1]:65535", "localhost:7070"}) {
    EXPECT_TRUE(Resolve({"--listen", good}).ok()) << good;
    EXPECT_TRUE(Resolve({"--metrics-listen", good}).ok()) << good;
  }
  struct Case {
    const char* flag;
    const char* value;
    const char* says;
  };
  for (const Case& c :
       {Case{"--listen", "127.0.0.1:99999", "no port in 0-65535"},
        Case{"--listen", "7180", "has no port"}, Case{"--listen", ":7070", "has no host"},
        Case{"--listen", "::1:7070", "IPv6 host without brackets"},
        Case{"--listen", "host:", "no port in 0-65535"},
        Case{"--metrics-listen", "127.0.0.1:http", "no port in 0-65535"},
        Case{"--health-listen", "127.0.0.1:-1", "no port in 0-65535"}}) {
    const absl::StatusOr<ShardSettings> settings = Resolve({c.flag, c.value});
    EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument) << c.value;
    EXPECT_THAT(std::string(settings.status().message()), HasSubstr(c.says)) << c.value;
    EXPECT_THAT(std::string(settings.status().message()),
                HasSubstr(absl::StrCat(c.flag, " '", c.value, "'")));
  }
}

TEST(ShardConfigTest, MemoryBudgetTakesKubernetesQuantities) {
  const absl::StatusOr<ShardSettings> settings = Resolve({"--memory-budget", "4Gi"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->memory_budget_bytes, 4ull << 30);
}

TEST(ShardConfigTest, An8BitFloatPolicyNeedsChunksThatHoldABlockAndItsScales) {
  // A block of 64 codes and three scales: 76 bytes.
  EXPECT_TRUE(Resolve({"--chunk-bytes", "76", "--policy", "c=f8e4m3,fp8_block=64"}).ok());
  EXPECT_TRUE(Resolve({"--chunk-bytes", "75", "--policy", "c=bf16"}).ok()) << "no fp8: any size";
  for (const char* policy : {"c=f8e4m3,fp8_block=64", "c=bf16,fp8_block=64;*proj*=f8e5m2"}) {
    const absl::StatusOr<ShardSettings> settings =
        Resolve({"--chunk-bytes", "75", "--policy", policy});
    EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument) << policy;
    EXPECT_THAT(std::string(settings.status().message()),
                HasSubstr("--chunk-bytes 75 cannot hold one block of 64 8-bit codes and three "
                          "scales"))
        << policy;
    EXPECT_THAT(std::string(settings.status().message()), HasSubstr("use at least 76"));
  }
}

TEST(ShardConfigTest, TrainingNeedsAnOptimizerAndAValidWorkerCount) {
  absl::StatusOr<ShardSettings> settings = Resolve({});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_FALSE(settings->optimizer.has_value()) << "read-only unless asked";
  EXPECT_EQ(settings->config.max_receive_message_bytes(), 64u << 10);

  settings = Resolve({"--optimizer", "adamw:lr=3e-4;*norm*:weight_decay=0"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  ASSERT_TRUE(settings->optimizer.has_value());
  EXPECT_EQ(settings->config.data_parallel_workers(), 1u);
  EXPECT_EQ(settings->config.max_receive_message_bytes(), 2u << 20)
      << "room for the worker library's 1 MiB gradient chunks";

  settings = Resolve({"--optimizer", "adam:lr=1"});
  EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(settings.status().message(), HasSubstr("--optimizer: "));
  settings = Resolve({"--data-parallel-workers", "2"});
  EXPECT_THAT(settings.status().message(), HasSubstr("needs --optimizer"));
  settings = Resolve({"--optimizer-state", "optimizer.safetensors"});
  EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(settings.status().message(), HasSubstr("--optimizer-state needs --optimizer"));
  settings = Resolve({"--optimizer", "sgd:lr=1", "--data-parallel-workers", "5000"});
  EXPECT_THAT(settings.status().message(), HasSubstr("use 1-4096"));
}

TEST(ShardConfigTest, ThePushJournalAndPeriodicCheckpointsNeedTrainingAndACheckpointDir) {
  absl::StatusOr<ShardSettings> settings =
      Resolve({"--optimizer", "sgd:lr=1", "--checkpoint-dir", "/tmp"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_TRUE(settings->config.push_journal()) << "on by default where it can be kept";
  settings = Resolve({"--optimizer", "sgd:lr=1"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_FALSE(settings->config.push_journal()) << "nowhere to keep it";
  settings = Resolve({"--checkpoint-dir", "/tmp"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_FALSE(settings->config.push_journal()) << "a read-only shard takes no pushes";

  settings = Resolve({"--push-journal", "true", "--checkpoint-dir", "/tmp"});
  EXPECT_THAT(settings.status().message(), HasSubstr("--push-journal true needs --optimizer"));
  settings = Resolve({"--checkpoint-every", "10", "--optimizer", "sgd:lr=1"});
  EXPECT_THAT(settings.status().message(), HasSubstr("--checkpoint-every needs"));
  settings =
      Resolve({"--checkpoint-every", "10", "--optimizer", "sgd:lr=1", "--checkpoint-dir", "/tmp"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->config.checkpoint_every(), 10u);
}

TEST(ShardConfigTest, JournalSyncIsOneOfThreePoliciesAndItsIntervalGoesWithGrouped) {
  const std::vector<std::string> journal = {"--optimizer", "sgd:lr=1", "--checkpoint-dir", "/tmp"};
  const auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.begin(), journal.begin(), journal.end());
    return Resolve(std::move(flags));
  };
  absl::StatusOr<ShardSettings> settings = with({});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->journal_sync, PushJournal::Sync::kNone) << "the default";
  EXPECT_EQ(settings->config.journal_sync(), "none");
  EXPECT_EQ(settings->config.journal_sync_interval_ms(), 10u);
  settings = with({"--journal-sync", "every-push"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->journal_sync, PushJournal::Sync::kEveryPush);
  settings = with({"--journal-sync", "grouped", "--journal-sync-interval-ms", "0"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->journal_sync, PushJournal::Sync::kGrouped);
  EXPECT_EQ(settings->config.journal_sync_interval_ms(), 0u);

  for (const char* bad : {"fsync", "", "Grouped", "every_push"}) {
    settings = with({"--journal-sync", bad});
    if (absl::string_view(bad).empty()) continue;  // empty is unset: the default
    EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(
        std::string(settings.status().message()),
        HasSubstr(absl::StrCat("--journal-sync: journal sync '", bad, "' is not one of: none (")))
        << bad;
  }
  settings = with({"--journal-sync", "grouped", "--journal-sync-interval-ms", "20000"});
  EXPECT_THAT(settings.status().message(),
              HasSubstr("--journal-sync-interval-ms 20000 is out of range: use 0-10000"));
  settings = with({"--journal-sync-interval-ms", "5"});
  EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(settings.status().message(),
              HasSubstr("--journal-sync-interval-ms 5 spaces the syncs of --journal-sync grouped, "
                        "and --journal-sync is 'none'"));
  settings = Resolve({"--optimizer", "sgd:lr=1", "--journal-sync", "every-push"});
  EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(settings.status().message(), HasSubstr("need a push journal to sync"));
  settings = with({"--push-journal", "false", "--journal-sync", "grouped"});
  EXPECT_THAT(settings.status().message(), HasSubstr("need a push journal to sync"));
}

TEST(ShardConfigTest, LayerGroupingFollowsTheFlags) {
  absl::StatusOr<ShardSettings> settings = Resolve({});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->grouping.first_prefix, "model.embed_tokens.");
  settings = Resolve({"--layer-regex", R"(^blocks\.(\d+)\.)", "--first-layer-prefix", "embed."});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->grouping.first_prefix, "embed.");
  EXPECT_EQ(settings->grouping.layer_regex, R"(^blocks\.(\d+)\.)");
  settings = Resolve({"--first-layer-prefix", ""});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->grouping.first_prefix, "") << "empty: no first layer";
}

TEST(ShardConfigTest, PinnedReadsKeepVersionsForAWhileAndNeedTheChangeLog) {
  // A shard that can change (publishes here) keeps 4 versions' changes.
  absl::StatusOr<ShardSettings> settings = Resolve({"--admin-token-file", "/run/token"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->config.delta_versions(), 4u);
  EXPECT_EQ(settings->config.pin_retention_ms(), 30000u);
  settings = Resolve({"--optimizer", "sgd:lr=0.1"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->config.delta_versions(), 4u);
  // One nobody can change records nothing, unless asked to.
  settings = Resolve({});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->config.delta_versions(), 0u);
  EXPECT_EQ(settings->config.pin_retention_ms(), 0u);
  settings = Resolve({"--delta-versions", "2"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->config.delta_versions(), 2u);
  settings = Resolve({"--delta-versions", "0"});
  ASSERT_TRUE(settings.ok()) << settings.status() << ": the default gives way";
  EXPECT_EQ(settings->config.pin_retention_ms(), 0u);
  settings = Resolve({"--delta-versions", "0", "--pin-retention-ms", "0"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  settings = Resolve({"--delta-versions", "0", "--pin-retention-ms", "5000"});
  EXPECT_EQ(settings.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(settings.status().message(), HasSubstr("needs --delta-versions of at least 1"));
  settings = Resolve({"--pin-retention-ms", "3600001"});
  EXPECT_THAT(settings.status().message(), HasSubstr("use 0-3600000"));
}

// config.proto writes each default once; --help and the resolved config
// both come from it.
TEST(ShardConfigTest, DefaultsComeFromTheProtoIntoHelpAndConfig) {
  const std::string help = ShardFlagsHelp();
  EXPECT_THAT(help, Not(HasSubstr("{default}")));
  EXPECT_THAT(help, Not(HasSubstr("{max}")));
  EXPECT_THAT(help, HasSubstr("default 1048576, at least"));
  const absl::StatusOr<ShardSettings> settings = Resolve({});
  ASSERT_TRUE(settings.ok()) << settings.status();
  const google::protobuf::FieldOptions& chunk =
      layercast::v1::ShardConfig::descriptor()->FindFieldByName("chunk_bytes")->options();
  EXPECT_EQ(settings->config.chunk_bytes(), chunk.GetExtension(layercast::v1::default_value));
  EXPECT_EQ(settings->config.listen(), "127.0.0.1:7070");
  EXPECT_EQ(settings->config.max_streams(), 1024u);
  EXPECT_EQ(settings->config.max_receive_message_bytes(), 65536u);
  const absl::StatusOr<ShardSettings> training = Resolve({"--optimizer", "sgd:lr=0.1"});
  ASSERT_TRUE(training.ok()) << training.status();
  EXPECT_EQ(training->config.max_receive_message_bytes(), 2u << 20);
  EXPECT_EQ(training->config.data_parallel_workers(), 1u);
  EXPECT_EQ(training->config.delta_versions(), 4u);
  EXPECT_EQ(training->config.pin_retention_ms(), 30000u);
}

TEST(ShardConfigTest, LogFormatAndLevel) {
  absl::StatusOr<ShardSettings> settings = Resolve({});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->log_format, LogFormat::kText);
  EXPECT_EQ(settings->log_level, spdlog::level::info);
  settings = Resolve({"--log-format", "json", "--log-level", "warn"});
  ASSERT_TRUE(settings.ok()) << settings.status();
  EXPECT_EQ(settings->log_format, LogFormat::kJson);
  EXPECT_EQ(settings->log_level, spdlog::level::warn);
}

}  // namespace
}  // namespace layercast::server
