// The command-line tools as a newcomer meets them: help for every command
// with its defaults, --version on both binaries, a layer fetched by name,
// the publishing demo, and the frictions an operator met: a shard started
// with nothing, a bench of no rounds, a checkpoint of a shard that is down,
// progress written to a file, the dry run's wording, a file's model id.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;

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
  for (const char* command :
       {"manifest", "fetch", "export", "bench", "checkpoint", "demo", "help"}) {
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

TEST(CliTest, AShardStartedWithoutWhatItNeedsSaysHowToStartIt) {
  std::string output;
  EXPECT_EQ(RunCommand(ShardBinary(), &output), 2);
  EXPECT_THAT(output, HasSubstr("usage: layercast-shard"));
  EXPECT_THAT(output, HasSubstr("--help lists every flag"));
  EXPECT_EQ(RunCommand(ShardBinary() + " --dry-run --synthetic llama:layers=1,hidden=64", &output),
            2);
  EXPECT_THAT(output, HasSubstr("--num-shards N is required"));
}

TEST(CliTest, TheDryRunNamesAFilesModelByItsStemAndCountsSmallModels) {
  const std::string dir = MakeTempDir("cli_model_id");
  WriteTestModel(dir + "/tiny-llama.safetensors", 1, 3);
  std::filesystem::create_directories(dir + "/my-model");
  WriteTestModel(dir + "/my-model/model.safetensors", 1, 3);
  std::string output;
  ASSERT_EQ(RunCommand(absl::StrCat(ShardBinary(), " --dry-run --num-shards 1 --model ", dir,
                                    "/tiny-llama.safetensors"),
                       &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("model tiny-llama: "));
  EXPECT_THAT(output, ContainsRegex("[0-9.]+ k parameters, on 1 shard;"));
  ASSERT_EQ(RunCommand(absl::StrCat(ShardBinary(), " --dry-run --num-shards 2 --model ", dir,
                                    "/my-model/model.safetensors"),
                       &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("model my-model: "));
  // How the tensors were grouped into layers.
  EXPECT_THAT(output, ContainsRegex("layers: model.embed_tokens \\(1 tensor\\), model.layers.0 "
                                    "\\([0-9]+ tensors\\)"));
  EXPECT_THAT(output, HasSubstr("on 2 shards;"));
}

// A port in use: one clear line (gRPC's own nested dump only at debug
// level, and JSON stays JSON) and exit 2, like any other start-up mistake.
TEST(CliTest, ABusyPortIsOneClearErrorInTheLogsFormat) {
  RunningShards running = StartShards(1, {"--synthetic", "llama:layers=1,hidden=64"});
  ASSERT_NE(running.set, nullptr);
  const std::string taken = running.processes->addresses()[0];
  const std::string start =
      absl::StrCat(ShardBinary(), " --num-shards 1 --synthetic llama:layers=1,hidden=64 ");
  std::string output;
  EXPECT_EQ(RunCommand(start + "--log-format json --listen " + taken, &output), 2);
  EXPECT_THAT(output, HasSubstr("cannot listen on " + taken));
  EXPECT_THAT(output, Not(HasSubstr("No address added"))) << "gRPC's dump before the line";
  for (const absl::string_view line : absl::StrSplit(output, '\n', absl::SkipEmpty())) {
    EXPECT_TRUE(absl::StartsWith(line, "{") && absl::EndsWith(line, "}"))
        << "not a JSON line: " << line;
  }
  EXPECT_EQ(RunCommand(start + "--listen 127.0.0.1:0 --metrics-listen " + taken, &output), 2);
  EXPECT_THAT(output, HasSubstr("cannot serve metrics on " + taken +
                                ": the address is in use or not local"));
}

TEST(CliTest, BenchRefusesNoRoundsAndCheckpointSaysNothingListens) {
  std::string output;
  EXPECT_EQ(RunCommand(CliBinary() + " bench --shards 127.0.0.1:1 --rounds 0", &output), 2);
  EXPECT_THAT(output, HasSubstr("--rounds must be at least 1"));
  const std::string dir = MakeTempDir("cli_checkpoint_down");
  EXPECT_NE(RunCommand(absl::StrCat(CliBinary(), " checkpoint --shards 127.0.0.1:1 --insecure ",
                                    "--connect-timeout-ms 500 --token-file ",
                                    WriteAdminToken(dir, "checkpoint-token-0123456789")),
                       &output),
            0);
  EXPECT_THAT(output, HasSubstr("connection refused: nothing listens at 127.0.0.1:1"));
  EXPECT_THAT(output, Not(HasSubstr("TLS")));
}

TEST(CliTest, ProgressWrittenToAFileIsALineATenth) {
  RunningShards shards =
      StartShards(1, {"--synthetic", "llama:layers=4,hidden=64,ffn=96,vocab=50"});
  ASSERT_NE(shards.set, nullptr);
  std::string output;
  // 6 layers x 10 rounds: 60 layers gathered, output not a terminal.
  ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " bench --rounds 10 --shards ",
                                    shards.processes->addresses()[0]),
                       &output),
            0)
      << output;
  size_t lines = 0;
  for (size_t at = output.find("so far"); at != std::string::npos;
       at = output.find("so far", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 5u) << output;
  EXPECT_LE(lines, 10u) << output;
  EXPECT_THAT(output, HasSubstr(" 60/60 "));
  EXPECT_THAT(output, Not(HasSubstr("\r")));
}

// The training demo trains something: its loss (0.5 * sum of the squared
// weights, whose gradient the worker pushes) falls at every step.
TEST(CliTest, TheTrainingDemosLossFalls) {
  std::string output;
  ASSERT_EQ(RunCommand(CliBinary() + " demo --train --steps 4 --synthetic " +
                           "llama:layers=1,hidden=128,ffn=256,vocab=512,seed=2",
                       &output),
            0)
      << output;
  std::vector<double> losses;
  for (const absl::string_view line : absl::StrSplit(output, '\n')) {
    const size_t at = line.find(" loss ");
    if (at == absl::string_view::npos) continue;
    double loss = 0;
    const absl::string_view rest = line.substr(at + 6);
    ASSERT_TRUE(absl::SimpleAtod(rest.substr(0, rest.find(' ')), &loss)) << line;
    losses.push_back(loss);
  }
  ASSERT_EQ(losses.size(), 4u) << output;
  for (size_t i = 1; i < losses.size(); ++i) {
    EXPECT_LT(losses[i], losses[i - 1]) << output;
  }
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
