// layercast-shard: serves one shard of a model. See ShardServer for the
// life cycle and proto/layercast/v1/config.proto for the flags.
//
// --dry-run reads only the model's headers and prints what every shard needs
// in memory (server/shard/dry_run.h); it exits 2 when --memory-budget is too small.
//
// Exit status: 0 after a clean stop (SIGTERM/SIGINT, drained, checkpoint
// written if configured); 2 when it refuses to start (bad flags, a model or
// budget that cannot work, bad TLS files or token, a mismatched or corrupt
// checkpoint); 1 for other failures (a port in use, a read error, a failed
// checkpoint on exit).

#include <algorithm>
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <csignal>
#include <cstdio>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/build_info.h"
#include "platform/log.h"
#include "programs/process_start.h"
#include "server/shard/dry_run.h"
#include "server/shard/shard_config.h"
#include "server/shard/shard_server.h"

namespace {

int Fail(const absl::Status& status, int code) {
  layercast::Log()->error("{}", status.message());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  layercast::StartProcess("layercast-shard", spdlog::level::info);
  using layercast::server::ShardServer;
  std::vector<std::string> args(argv + 1, argv + argc);
  // --dry-run is a mode, not a setting: it is no field of the config.
  const auto dry_run = std::find(args.begin(), args.end(), "--dry-run");
  const bool dry = dry_run != args.end();
  if (dry) args.erase(dry_run);
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      std::fputs(layercast::server::ShardFlagsHelp().c_str(), stdout);
      return 0;
    }
    if (arg == "--version") {
      std::puts(layercast::VersionLine("layercast-shard").c_str());
      return 0;
    }
  }
  if (args.empty() && !dry) {
    // The usage line, not a complaint about the first missing flag.
    const std::string help = layercast::server::ShardFlagsHelp();
    std::fprintf(stderr, "%s\nlayercast-shard --help lists every flag; docs/shard-flags.md too.\n",
                 help.substr(0, help.find('\n') + 1).c_str());
    return 2;
  }
  auto config = layercast::server::ParseShardFlags(args);
  if (!config.ok()) return Fail(config.status(), 2);
  auto settings = layercast::server::ResolveShardConfig(*std::move(config));
  if (!settings.ok()) return Fail(settings.status(), 2);
  if (dry) {
    auto report = layercast::server::DryRun(*settings);
    if (!report.ok()) return Fail(report.status(), 2);
    std::fputs(report->text.c_str(), stdout);
    return report->fits ? 0 : 2;
  }
  const layercast::v1::ShardConfig& resolved = settings->config;
  layercast::ConfigureLogging(
      "layercast-shard", settings->log_format, settings->log_level,
      {{"shard", absl::StrCat(resolved.shard_index(), "/", resolved.num_shards())}});
  // Asio owns the process's life: the main thread waits for a signal or for
  // loading to fail; loading runs beside it so a signal during a long load is
  // answered at once. The signal set is in place before the server is
  // created: a supervisor may send SIGTERM the moment the port file appears
  // (or earlier), and the default action would kill the shard instead of
  // stopping it. A signal that comes before async_wait waits for it.
  boost::asio::io_context io;
  boost::asio::signal_set signals(io, SIGINT, SIGTERM);
  auto server = ShardServer::Create(*std::move(settings));
  if (!server.ok()) return Fail(server.status(), 2);
  // A port in use is the operator's to change, like a bad flag: exit 2.
  if (absl::Status started = (*server)->Start(); !started.ok()) return Fail(started, 2);

  std::atomic<bool> stopping{false};
  int exit_code = 0;
  signals.async_wait([&](const boost::system::error_code& error, int signal) {
    if (error) return;
    layercast::Log()->info("received {}, draining", signal == SIGTERM ? "SIGTERM" : "SIGINT");
    stopping.store(true);
    io.stop();
  });
  std::thread loader([&] {
    absl::Status loaded = (*server)->Load(&stopping);
    if (!loaded.ok() && !stopping.load()) {
      boost::asio::post(io, [&, loaded] {
        // DATA_LOSS: a checkpoint that fails its checksum, refused like a
        // mismatched one.
        exit_code = Fail(loaded, absl::IsDataLoss(loaded) ? 2 : 1);
        io.stop();
      });
    }
  });
  io.run();
  loader.join();
  (*server)->Shutdown(std::chrono::seconds((*server)->settings().config.drain_timeout_seconds()));
  if (stopping.load()) {
    if (absl::Status saved = (*server)->CheckpointOnExit(); !saved.ok()) exit_code = Fail(saved, 1);
  }
  layercast::Log()->info("stopped");
  return exit_code;
}
