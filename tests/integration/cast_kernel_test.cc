// Every start of every shard of a set runs the same cast kernels: the
// choice comes from the CPU's model (core/cast_dispatch.cc), not from a
// timing race at start, so the shards of one set never disagree and a
// restart never changes what the metrics' cast_kernel label says.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/integration/shard_fixture.h"

namespace layercast::testing {
namespace {

constexpr int kStarts = 10;
constexpr uint32_t kShards = 2;

// What shard `shard` logged after "cast kernels: " in `dir`; "" when none.
std::string KernelsLogged(const std::string& dir, uint32_t shard) {
  std::ifstream log(absl::StrCat(dir, "/shard-", shard, ".log"));
  const std::string marker = "cast kernels: ";
  for (std::string line; std::getline(log, line);) {
    if (const size_t at = line.find(marker); at != std::string::npos) {
      return line.substr(at + marker.size());
    }
  }
  return "";
}

TEST(CastKernelTest, EveryStartOfEveryShardRunsTheSameKernels) {
  std::set<std::string> seen;
  std::vector<std::string> all;
  for (int start = 0; start < kStarts; ++start) {
    const std::string dir = MakeTempDir(absl::StrCat("kernels-", start));
    auto shards =
        StartProcesses(kShards, {"--synthetic", "llama:layers=1,hidden=32,ffn=48,vocab=20"}, dir);
    ASSERT_NE(shards, nullptr);
    // The line is logged before the port file StartProcesses waits for.
    for (uint32_t shard = 0; shard < kShards; ++shard) {
      const std::string kernels = KernelsLogged(dir, shard);
      ASSERT_FALSE(kernels.empty()) << "start " << start << ", shard " << shard;
      seen.insert(kernels);
      all.push_back(absl::StrCat("start ", start, " shard ", shard, ": ", kernels));
    }
    ASSERT_TRUE(shards->Stop().ok());
  }
  std::ostringstream listed;
  for (const std::string& line : all) listed << line << "\n";
  EXPECT_EQ(seen.size(), 1u) << listed.str();
  EXPECT_THAT(*seen.begin(), ::testing::StartsWith("by CPUID, ")) << listed.str();
}

TEST(CastKernelTest, VersionPrintsTheSameLineEveryRun) {
  std::set<std::string> lines;
  for (int run = 0; run < 3; ++run) {
    std::string output;
    ASSERT_EQ(RunCommand(absl::StrCat(ShardBinary(), " --version"), &output), 0) << output;
    lines.insert(output);
  }
  EXPECT_EQ(lines.size(), 1u) << ::testing::PrintToString(lines);
}

}  // namespace
}  // namespace layercast::testing
