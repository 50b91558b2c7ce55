#include "server/shard/dry_run.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/shard/shard_config.h"

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

// The cast cache's line: how many layers the capacity holds, in the order
// a walk reads them, none without the flag.
TEST(DryRunTest, ShowsWhatTheCastCacheWouldHold) {
  const absl::StatusOr<DryRunReport> off = DryRunWith({"--num-shards", "1"});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_THAT(off->text, ::testing::Not(HasSubstr("cast cache")));
  // The embedding (1024 x 256 in bfloat16, 512 KiB) fits; layer 0 and the
  // final layer (its norm and a head as large as the embedding) do not.
  const absl::StatusOr<DryRunReport> on =
      DryRunWith({"--num-shards", "1", "--policy", "p=f32,c=bf16", "--cast-cache-bytes", "524288"});
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_THAT(on->text, HasSubstr("cast cache (--cast-cache-bytes 512.00 KiB"));
  EXPECT_THAT(on->text, HasSubstr("shard 0/1: 1 of 3 layers, 512.00 KiB of the "));
  // A training shard's every step is a new version: nothing kept is read.
  const absl::StatusOr<DryRunReport> training =
      DryRunWith({"--num-shards", "1", "--optimizer", "sgd:lr=0.1", "--cast-cache-bytes", "1"});
  EXPECT_EQ(training.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(training.status().message(), HasSubstr("serves a read-only shard"));
}

}  // namespace
}  // namespace layercast::server
