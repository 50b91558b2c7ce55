#include "server/dry_run.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/shard_config.h"

namespace layercast::server {
namespace {

using ::testing::HasSubstr;

constexpr const char* kModel = "llama:layers=1,hidden=256,ffn=512,vocab=1024,seed=1";

absl::StatusOr<DryRunReport> DryRunWith(std::vector<std::string> args) {
  args.insert(args.end(), {"--synthetic", kModel});
  absl::StatusOr<layercast::v1::ShardConfig> config = ParseShardFlags(args);
  if (!config.ok()) return config.status();
  absl::StatusOr<ShardSettings> settings = ResolveShardConfig(*std::move(config));
  if (!settings.ok()) return settings.status();
  return DryRun(*settings);
}

// A policy that the shard would refuse as it loads is refused by the dry
// run too, with the shard's message, not reported as fitting.
TEST(DryRunTest, RefusesAnFp8BlockThatTwoShardsWouldSplit) {
  // With 3 shards the embedding's 1024 x 256 elements split at 87381,
  // inside a block of 128; with 2, every tensor splits on a block boundary.
  const absl::StatusOr<DryRunReport> split =
      DryRunWith({"--num-shards", "3", "--policy", "p=f32,c=float8_e4m3fn,fp8_block=128"});
  EXPECT_EQ(split.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(split.status().message(), HasSubstr("inside a block"));

  const absl::StatusOr<DryRunReport> whole =
      DryRunWith({"--num-shards", "2", "--policy", "p=f32,c=float8_e4m3fn,fp8_block=128",
                  "--memory-budget", "1Gi"});
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_TRUE(whole->fits);
  EXPECT_THAT(whole->text, HasSubstr("float8_e4m3fn"));
}

}  // namespace
}  // namespace layercast::server
