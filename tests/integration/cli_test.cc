// The command-line tools as a newcomer meets them: help for every command
// with its defaults, --version on both binaries, a layer fetched by name,
// the publishing demo.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/integration/shard_fixture.h"

namespace layercast::testing {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

TEST(CliTest, VersionNamesReleaseCommitBuildAndCastKernel) {
  // One variant where every cast uses it, else each cast's.
  const std::string variant = "(scalar|avx2|avx512|avx512bf16)";
  const std::string kernels =
      absl::StrCat("(", variant, "|f32_to_bf16=", variant, ",f32_to_f16=", variant,
                   ",bf16_to_f32=", variant, ",f16_to_f32=", variant, ")");
  for (const std::string& binary : {CliBinary(), ShardBinary()}) {
    std::string output;
    ASSERT_EQ(RunCommand(binary + " --version", &output), 0) << output;
    EXPECT_THAT(output, MatchesRegex(absl::StrCat("layercast(-shard)? [0-9]+\\.[0-9]+\\.[0-9]+ "
                                                  "\\(commit ([0-9a-f]+|unknown), [A-Za-z]+ build, "
                                                  "cast kernel ",
                                                  kernels, "\\)\n")));
  }
}

TEST(CliTest, HelpForEveryCommandWithDefaults) {
  std::string output;
  ASSERT_EQ(RunCommand(CliBinary() + " help", &output), 0) << output;
  for (const char* command : {"manifest", "fetch", "bench", "checkpoint", "demo", "help"}) {
    EXPECT_THAT(output, HasSubstr(std::string("  ") + command)) << output;
  }
  EXPECT_THAT(output, HasSubstr("--connect-timeout-ms MS"));
  // Both spellings of a command's help, and its flags with their defaults.
  for (const char* help : {" help fetch", " fetch --help", " fetch -h"}) {
    ASSERT_EQ(RunCommand(CliBinary() + help, &output), 0) << help << ": " << output;
    EXPECT_THAT(output, HasSubstr("--timeout-ms MS")) << help;
    EXPECT_THAT(output, HasSubstr("(default 60000)")) << help;
    EXPECT_THAT(output, HasSubstr("--shards A,B,...")) << help;
  }
  EXPECT_EQ(RunCommand(CliBinary() + " help nosuch", &output), 2);
  EXPECT_THAT(output, HasSubstr("unknown command 'nosuch'"));
  // A flag mistake points at the command's help.
  EXPECT_EQ(RunCommand(CliBinary() + " fetch --layr 1", &output), 2);
  EXPECT_THAT(output, HasSubstr("layercast fetch --help lists its flags"));
}

TEST(CliTest, FetchTakesALayerByName) {
  RunningShards shards =
      StartShards(2, {"--synthetic", "llama:layers=2,hidden=64,ffn=96,vocab=50"});
  ASSERT_NE(shards.set, nullptr);
  const std::string dir = MakeTempDir("cli_fetch_by_name");
  const std::string list = absl::StrJoin(shards.processes->addresses(), ",");
  std::string output;
  ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " fetch --shards ", list,
                                    " --layer model.layers.1 --out ", dir, "/by_name.safetensors"),
                       &output),
            0)
      << output;
  // Layer 0 is the embedding, then model.layers.0 and .1: index 2.
  ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " fetch --shards ", list, " --layer 2 --out ", dir,
                                    "/by_index.safetensors"),
                       &output),
            0)
      << output;
  const auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string by_name = read(dir + "/by_name.safetensors");
  EXPECT_GT(by_name.size(), 1000u);
  EXPECT_EQ(by_name, read(dir + "/by_index.safetensors"));
  EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(), " fetch --shards ", list,
                                    " --layer model.layers.9 --out ", dir, "/x.safetensors"),
                       &output),
            1);
  EXPECT_THAT(output, HasSubstr("the model has no layer named 'model.layers.9'"));
}

TEST(CliTest, ThePublishDemoKeepsEveryMirrorBitIdenticalAndStopsCleanly) {
  std::string output;
  ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " demo --publish --steps 3 --mirrors 2 ",
                                    "--synthetic llama:layers=2,hidden=64,ffn=96,vocab=50 ",
                                    "--shard-binary ", ShardBinary(), " 2>/dev/null"),
                       &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("published version 3"));
  // Updates may coalesce when a mirror falls a version behind.
  EXPECT_THAT(output, ContainsRegex("mirror 1 +[1-3] updates"));
  EXPECT_THAT(output, HasSubstr("bit-identical to a full pull of every layer"));
  EXPECT_THAT(output, HasSubstr("shards stopped    cleanly (exit 0)"));
  EXPECT_EQ(RunCommand(CliBinary() + " demo --publish --train", &output), 2);
  EXPECT_THAT(output, HasSubstr("give --train or --publish, not both"));
  EXPECT_EQ(RunCommand(CliBinary() + " demo --mirrors 3", &output), 2);
  EXPECT_THAT(output, HasSubstr("--mirrors and --lr need --publish"));
}

}  // namespace
}  // namespace layercast::testing
