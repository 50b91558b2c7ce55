// One logger: a shard started with --log-format json writes nothing but JSON
// lines a collector can parse, each naming its shard; the worker library's
// messages reach a host that routes them.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <csignal>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "core/log.h"
#include "tests/integration/shard_fixture.h"

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
