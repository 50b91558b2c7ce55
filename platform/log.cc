#include "platform/log.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <memory>
#include <mutex>

#include <nlohmann/json.hpp>

#include "absl/base/const_init.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"

namespace layercast {
namespace {

constexpr char kLoggerName[] = "layercast";

// Formats a message as one JSON object; nlohmann escapes the text, which
// spdlog's patterns would not.
class JsonFormatter final : public spdlog::formatter {
 public:
  JsonFormatter(std::string program, LogFields fields)
      : program_(std::move(program)), fields_(std::move(fields)) {}

  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    timestamp_.format(msg, dest);  // leaves `{"time":"...",` in dest
    const spdlog::string_view_t level = spdlog::level::to_string_view(msg.level);
    // ordered_json: the fields in the order written here, level first.
    nlohmann::ordered_json line = {{"level", std::string(level.data(), level.size())},
                                   {"program", program_}};
    for (const auto& [key, value] : fields_) line[key] = value;
    line["msg"] = std::string(msg.payload.data(), msg.payload.size());
    const std::string rest = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    dest.append(rest.data() + 1, rest.data() + rest.size());  // without its '{'
    dest.push_back('\n');
  }

  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>(program_, fields_);
  }

 private:
  const std::string program_;
  const LogFields fields_;
  spdlog::pattern_formatter timestamp_{R"({"time":"%Y-%m-%dT%H:%M:%S.%eZ",)",
                                       spdlog::pattern_time_type::utc, ""};
};

// Forwards each message to a function. spdlog 1.10 (Debian bookworm's) has
// no callback sink; 1.11 added one.
class FunctionSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit FunctionSink(LogSink sink) : sink_(std::move(sink)) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    sink_(msg.level, absl::string_view(msg.payload.data(), msg.payload.size()));
  }
  void flush_() override {}

 private:
  LogSink sink_;
};

std::shared_ptr<spdlog::logger> MakeStderrLogger(const std::string& program, LogFormat format,
                                                 spdlog::level::level_enum level,
                                                 const LogFields& fields) {
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  if (format == LogFormat::kJson) {
    sink->set_formatter(std::make_unique<JsonFormatter>(program, fields));
  } else {
    std::string tags;
    for (const auto& [key, value] : fields) {
      absl::StrAppend(&tags, tags.empty() ? "[" : " ", key, "=", value);
    }
    if (!tags.empty()) tags += "] ";
    // A '%' in the program or a tag would read as a pattern flag.
    std::string prefix = absl::StrCat(tags, program);
    absl::StrReplaceAll({{"%", "%%"}}, &prefix);
    sink->set_formatter(std::make_unique<spdlog::pattern_formatter>(
        absl::StrCat("%Y-%m-%dT%H:%M:%S.%eZ %L ", prefix, ": %v"), spdlog::pattern_time_type::utc));
  }
  auto logger = std::make_shared<spdlog::logger>(kLoggerName, std::move(sink));
  logger->set_level(level);
  // Every line reaches the collector at once: a shard that is killed loses none.
  logger->flush_on(spdlog::level::trace);
  return logger;
}

// The one logger. Not spdlog's registry: replacing a logger there would
// destroy it under a thread still writing to it; here each caller holds its
// own reference while it writes.
ABSL_CONST_INIT absl::Mutex current_mu(absl::kConstInit);
// Never freed: messages may be logged while static objects are destroyed.
std::shared_ptr<spdlog::logger>* current ABSL_GUARDED_BY(current_mu) = nullptr;

void Install(std::shared_ptr<spdlog::logger> replacement) {
  absl::MutexLock lock(&current_mu);
  if (current == nullptr) current = new std::shared_ptr<spdlog::logger>();
  *current = std::move(replacement);
}

}  // namespace

std::shared_ptr<spdlog::logger> Log() {
  absl::MutexLock lock(&current_mu);
  if (current == nullptr) {
    current = new std::shared_ptr<spdlog::logger>(
        MakeStderrLogger("layercast", LogFormat::kText, spdlog::level::info, {}));
  }
  return *current;
}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("log format '", name, "' is not one of: text, json (JSON lines)"));
}

absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view name) {
  if (name == "warn") return spdlog::level::warn;  // spdlog's own name is "warning"
  for (int level = spdlog::level::trace; level < spdlog::level::n_levels; ++level) {
    const auto named = spdlog::level::to_string_view(static_cast<spdlog::level::level_enum>(level));
    if (name == absl::string_view(named.data(), named.size())) {
      return static_cast<spdlog::level::level_enum>(level);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "log level '", name, "' is not one of: trace, debug, info, warn, error, critical, off"));
}

void ConfigureLogging(std::string program, LogFormat format, spdlog::level::level_enum level,
                      LogFields fields) {
  Install(MakeStderrLogger(program, format, level, fields));
}

void RouteLogs(LogSink sink, spdlog::level::level_enum level) {
  auto logger = std::make_shared<spdlog::logger>(kLoggerName,
                                                 std::make_shared<FunctionSink>(std::move(sink)));
  logger->set_level(level);
  Install(std::move(logger));
}

}  // namespace layercast
