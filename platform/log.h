#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace layercast {

// Every message layercast writes, from the shard server and from the worker
// library, goes through one spdlog logger. A program picks the format once
// at start (ConfigureLogging); a program that embeds the worker library may
// instead take the messages itself (RouteLogs). Until either is called,
// messages go to stderr as text at level info and above.
//
//   Log()->info("listening on {} ({})", address, transport);
//
// Thread-safe: spdlog serialises the sinks, and each caller holds the
// logger it writes to, so replacing it meanwhile is safe.
std::shared_ptr<spdlog::logger> Log();

enum class LogFormat {
  // "2026-11-30T21:12:10.123Z I [shard=0/2] layercast-shard: listening on ..."
  kText,
  // One JSON object a line, for Kubernetes log collectors:
  // {"time":"2026-11-30T21:12:10.123Z","level":"info",
  //  "program":"layercast-shard","shard":"0/2","msg":"listening on ..."}
  kJson,
};

// Fields every line carries besides the message, e.g. {{"shard", "0/2"}}.
using LogFields = std::vector<std::pair<std::string, std::string>>;

// "text" or "json"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);
// "trace", "debug", "info", "warn", "error", "critical" or "off".
absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view name);

// Writes to stderr in `format`, messages at `level` and above, each naming
// `program` and carrying `fields`. Replaces any earlier choice.
void ConfigureLogging(std::string program, LogFormat format,
                      spdlog::level::level_enum level = spdlog::level::info, LogFields fields = {});

// Hands every message at `level` and above to `sink` instead of writing it:
// for a host that has a logger of its own. `sink` runs on the logging
// thread under spdlog's lock, so it must be quick and must not log through
// Log(). Replaces any earlier choice; a thread that took the logger before
// may still write one message to the earlier sink after this returns, so a
// sink must stay valid until the host stops (or routes elsewhere and lets
// the threads that log go quiet first).
using LogSink = std::function<void(spdlog::level::level_enum level, absl::string_view message)>;
void RouteLogs(LogSink sink, spdlog::level::level_enum level = spdlog::level::info);

}  // namespace layercast

// Debian's abseil has a string_view of its own, not std's: let fmt (and so
// Log()) print it, as it prints std::string_view.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  template <typename Context>
  auto format(absl::string_view text, Context& context) const {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(text.data(), text.size()),
                                                    context);
  }
};
