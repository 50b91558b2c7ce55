// One logger: a shard started with --log-format json writes nothing but JSON
// lines a collector can parse, each naming its shard; the worker library's
// messages reach a host that routes them.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "core/safetensors.h"
#include "platform/log.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kModel[] = "llama:layers=2,hidden=64,ffn=96,vocab=128,seed=4";

TEST(LoggingTest, JsonLogIsOneObjectALineFromStartToStop) {
  const std::string logs = MakeTempDir("logging_json");
  auto shards = StartProcesses(1, {"--synthetic", kModel, "--log-format", "json"}, logs);
  ASSERT_NE(shards, nullptr);
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::seconds(60);
  ASSERT_TRUE(client::ShardSet::Connect(shards->addresses(), connect).ok());
  shards->SignalForTest(0, SIGTERM);
  absl::StatusOr<int> code = shards->WaitForExitForTest(0, std::chrono::seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);

  std::ifstream in(logs + "/shard-0.log");
  std::string line;
  std::vector<std::string> messages;
  while (std::getline(in, line)) {
    const nlohmann::json parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(parsed.is_object()) << "not a JSON object: " << line;
    for (const char* field : {"time", "level", "program", "shard", "msg"}) {
      ASSERT_TRUE(parsed.contains(field)) << field << " missing in " << line;
    }
    EXPECT_EQ(parsed["program"], "layercast-shard");
    EXPECT_EQ(parsed["shard"], "0/1");
    messages.push_back(parsed["msg"]);
  }
  ASSERT_GE(messages.size(), 4u);
  EXPECT_THAT(messages.front(), HasSubstr("listening on 127.0.0.1:"));
  EXPECT_THAT(messages, ::testing::Contains(HasSubstr("ready")));
  EXPECT_THAT(messages, ::testing::Contains("received SIGTERM, draining"));
  EXPECT_EQ(messages.back(), "stopped");
}

// A per-tensor rule whose glob matches nothing is most often a typo: the
// shard says so at start, and serves on.
TEST(LoggingTest, RulesThatMatchNoTensorAreWarnedAbout) {
  const std::string logs = MakeTempDir("logging_rules");
  auto shards = StartProcesses(1,
                               {"--synthetic", kModel, "--policy", "c=bf16;*nrom*=f32;*norm*=f32",
                                "--optimizer", "sgd:lr=1;*baises*:lr=0"},
                               logs);
  ASSERT_NE(shards, nullptr);
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::seconds(60);
  ASSERT_TRUE(client::ShardSet::Connect(shards->addresses(), connect).ok());
  ASSERT_EQ(shards->Stop(), absl::OkStatus());
  std::ifstream in(logs + "/shard-0.log");
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(log, HasSubstr("--policy override '*nrom*=float32' matches no tensor of"));
  EXPECT_THAT(log, HasSubstr("--optimizer override '*baises*' matches no tensor of"));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("override '*norm*")));
}

// --model takes a Hugging Face folder (its model.safetensors), names the
// model after the folder, and says what it widens; names that match no
// layer rule (GPT-2's) are warned about, naming --layer-regex.
TEST(LoggingTest, AModelFolderIsServedAndWhatItWidensOrCannotGroupIsSaid) {
  const std::string dir = MakeTempDir("models") + "/tiny-llama";
  std::filesystem::create_directories(dir);
  WriteTestModel(dir + "/model.safetensors", 2, 7);  // F32, BF16 and F16 tensors
  const std::string gpt2 = MakeTempDir("gpt2") + "/gpt2.safetensors";
  {
    auto writer =
        SafetensorsWriter::Create(gpt2,
                                  {{"transformer.h.0.attn.c_attn.weight", DType::kFloat32, {4, 4}},
                                   {"transformer.h.1.attn.c_attn.weight", DType::kFloat32, {4, 4}}},
                                  {});
    ASSERT_TRUE(writer.ok()) << writer.status();
    const std::vector<float> values(32, 0.5f);
    ASSERT_TRUE((*writer)
                    ->Append({reinterpret_cast<const uint8_t*>(values.data()), values.size() * 4})
                    .ok());
    ASSERT_TRUE((*writer)->Finish().ok());
  }
  const std::string logs = MakeTempDir("logging_models");
  auto folder = StartProcesses(1, {"--model", dir}, logs);
  ASSERT_NE(folder, nullptr);
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::seconds(60);
  auto set = client::ShardSet::Connect(folder->addresses(), connect);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ((*set)->model().model_id, "tiny-llama");
  ASSERT_EQ(folder->Stop(), absl::OkStatus());
  std::ifstream in(logs + "/shard-0.log");
  std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(log, HasSubstr("serving " + dir + "/model.safetensors as model 'tiny-llama'"));
  EXPECT_THAT(log, HasSubstr("are stored as BF16: widened exactly to the fp32 master"));
  EXPECT_THAT(log, HasSubstr("are stored as F16"));

  std::string output;
  EXPECT_NE(RunCommand(ShardBinary() +
                           " --num-shards 1 --shard-index 0 --listen 127.0.0.1:0 "
                           "--model " +
                           MakeTempDir("empty-model-folder"),
                       &output),
            0);
  EXPECT_THAT(output, HasSubstr("is a folder with neither model.safetensors.index.json nor"));

  const std::string gpt2_logs = MakeTempDir("logging_gpt2");
  auto flat = StartProcesses(1, {"--model", gpt2}, gpt2_logs);
  ASSERT_NE(flat, nullptr);
  ASSERT_EQ(flat->Stop(), absl::OkStatus());
  std::ifstream gpt2_in(gpt2_logs + "/shard-0.log");
  log.assign(std::istreambuf_iterator<char>(gpt2_in), std::istreambuf_iterator<char>());
  EXPECT_THAT(log, HasSubstr("matched the layer rules"));
  EXPECT_THAT(log, HasSubstr("Set --layer-regex"));

  // An I32 tensor (position ids) is skipped with a warning; the rest serves.
  const std::string ids = MakeTempDir("position-ids") + "/ids.safetensors";
  {
    const std::string header =
        R"({"model.layers.0.w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
        R"("model.position_ids":{"dtype":"I32","shape":[2],"data_offsets":[8,16]}})";
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(header.size() >> (8 * i));
    std::ofstream(ids, std::ios::binary) << bytes << header << std::string(16, '\0');
  }
  const std::string ids_logs = MakeTempDir("logging_ids");
  auto skipping = StartProcesses(1, {"--model", ids}, ids_logs);
  ASSERT_NE(skipping, nullptr);
  ASSERT_EQ(skipping->Stop(), absl::OkStatus());
  std::ifstream ids_in(ids_logs + "/shard-0.log");
  log.assign(std::istreambuf_iterator<char>(ids_in), std::istreambuf_iterator<char>());
  EXPECT_THAT(log, HasSubstr("skipping tensor 'model.position_ids'"));
  EXPECT_THAT(log, HasSubstr("its dtype I32 is not a floating-point parameter"));
}

TEST(LoggingTest, AnUnknownLogFormatIsRefusedNamingTheChoices) {
  std::string output;
  EXPECT_EQ(RunCommand(ShardBinary() + " --num-shards 1 --synthetic " + kModel +
                           " --log-format xml --listen 127.0.0.1:0",
                       &output),
            2);
  EXPECT_THAT(output, HasSubstr("log format 'xml' is not one of: text, json"));
  EXPECT_EQ(RunCommand(ShardBinary() + " --num-shards 1 --synthetic " + kModel +
                           " --log-level loud --listen 127.0.0.1:0",
                       &output),
            2);
  EXPECT_THAT(output, HasSubstr("log level 'loud' is not one of: trace, debug, info"));
}

TEST(LoggingTest, AHostRoutesTheWorkerLibrarysMessages) {
  auto shards = StartProcesses(2, {"--synthetic", kModel});
  ASSERT_NE(shards, nullptr);
  absl::Mutex mu;
  std::vector<std::pair<spdlog::level::level_enum, std::string>> routed;
  RouteLogs([&](spdlog::level::level_enum level, absl::string_view message) {
    absl::MutexLock lock(&mu);
    routed.emplace_back(level, std::string(message));
  });
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::seconds(60);
  auto set = client::ShardSet::Connect(shards->addresses(), connect);
  ASSERT_TRUE(set.ok()) << set.status();
  // A shard that dies mid-walk: the gather's retries are logged as warnings.
  shards->KillForTest(1);
  client::GatherOptions options;
  options.timeout = std::chrono::milliseconds(600);
  EXPECT_FALSE((*set)->Gather(0, options).ok());
  ConfigureLogging("layercast", LogFormat::kText);  // stop routing before `routed` goes
  absl::MutexLock lock(&mu);
  ASSERT_FALSE(routed.empty());
  EXPECT_EQ(routed.front().first, spdlog::level::info);
  EXPECT_THAT(routed.front().second, HasSubstr("connected to 2 shard(s) serving synthetic:llama"));
  bool retry_logged = false;
  for (const auto& [level, message] : routed) {
    retry_logged |= level == spdlog::level::warn && absl::StrContains(message, "retrying in");
  }
  EXPECT_TRUE(retry_logged) << "no retry warning among " << routed.size() << " messages";
}

}  // namespace
}  // namespace layercast::testing
