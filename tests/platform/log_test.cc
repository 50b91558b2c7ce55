#include "platform/log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace layercast {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

// Restores the default logger after each test: the logger is process-wide.
class LogTest : public ::testing::Test {
 protected:
  void TearDown() override { ConfigureLogging("layercast", LogFormat::kText); }
};

TEST_F(LogTest, JsonEscapesWhatAMessageCarries) {
  ConfigureLogging("prog", LogFormat::kJson, spdlog::level::info, {{"shard", "1/4"}});
  const std::string message = "path \"C:\\models\"\nnext line\ttab \x01 and invalid \xff utf-8";
  ::testing::internal::CaptureStderr();
  Log()->warn("{}", message);
  Log()->debug("below the level: not written");
  const std::string written = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(std::count(written.begin(), written.end(), '\n'), 1) << written;
  const nlohmann::json line = nlohmann::json::parse(written);
  EXPECT_THAT(line["time"].get<std::string>(),
              MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z"));
  EXPECT_EQ(line["level"], "warning");
  EXPECT_EQ(line["program"], "prog");
  EXPECT_EQ(line["shard"], "1/4");
  // The invalid byte becomes U+FFFD; everything else arrives as written.
  EXPECT_EQ(line["msg"], "path \"C:\\models\"\nnext line\ttab \x01 and invalid \xEF\xBF\xBD utf-8");
}

TEST_F(LogTest, TextNamesTimeLevelFieldsAndProgram) {
  ConfigureLogging("layercast-shard", LogFormat::kText, spdlog::level::info, {{"shard", "0/2"}});
  ::testing::internal::CaptureStderr();
  Log()->info("listening on {} ({})", "127.0.0.1:7070", "plaintext");
  const std::string written = ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(written, MatchesRegex("[0-9T:.-]+Z I \\[shard=0/2\\] layercast-shard: listening on "
                                    "127\\.0\\.0\\.1:7070 \\(plaintext\\)\n"));
}

TEST_F(LogTest, RoutedMessagesReachTheHostAtItsLevel) {
  std::vector<std::pair<spdlog::level::level_enum, std::string>> routed;
  RouteLogs([&](spdlog::level::level_enum level,
                absl::string_view message) { routed.emplace_back(level, std::string(message)); },
            spdlog::level::warn);
  ::testing::internal::CaptureStderr();
  Log()->info("not routed: below warn");
  Log()->error("shard {} failed", 3);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << "routed messages are not written";
  ASSERT_EQ(routed.size(), 1u);
  EXPECT_EQ(routed[0].first, spdlog::level::err);
  EXPECT_EQ(routed[0].second, "shard 3 failed");
}

TEST_F(LogTest, ParsesFormatsAndLevelsAndNamesTheChoices) {
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_EQ(*ParseLogFormat("text"), LogFormat::kText);
  EXPECT_THAT(std::string(ParseLogFormat("JSON").status().message()),
              HasSubstr("not one of: text, json"));
  EXPECT_EQ(*ParseLogLevel("debug"), spdlog::level::debug);
  EXPECT_EQ(*ParseLogLevel("off"), spdlog::level::off);
  EXPECT_EQ(*ParseLogLevel("warn"), spdlog::level::warn);
  EXPECT_EQ(*ParseLogLevel("warning"), spdlog::level::warn);
  EXPECT_EQ(ParseLogLevel("verbose").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace layercast
