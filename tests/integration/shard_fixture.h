#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <prometheus/registry.h>

#include "client/shard_set.h"
#include "tools/local_shard_set.h"

namespace layercast::testing {

// Paths of the binaries under test, from the build.
inline std::string ShardBinary() { return LAYERCAST_SHARD_BINARY; }
inline std::string CliBinary() { return LAYERCAST_CLI_BINARY; }

// A fresh directory under the test's temp dir.
std::string MakeTempDir(const std::string& name);

// Starts `n` real layercast-shard processes with `flags` (stderr to
// `log_dir`/shard-<i>.log when given); fails the test and returns nullptr
// on error.
std::unique_ptr<tools::LocalShardSet> StartProcesses(uint32_t n, std::vector<std::string> flags,
                                                     const std::string& log_dir = "");

// Starts `num_shards` real layercast-shard processes with `flags` (stderr
// to `log_dir` when given, as StartProcesses) and connects a ShardSet to
// them, its worker metrics in `registry`; fails the test on error.
struct RunningShards {
  std::unique_ptr<tools::LocalShardSet> processes;
  std::shared_ptr<prometheus::Registry> registry;
  std::unique_ptr<client::ShardSet> set;
};
RunningShards StartShards(uint32_t num_shards, std::vector<std::string> flags,
                          const std::string& log_dir = "");

// The sum of the counter (or gauge) `name` over its label sets in
// `registry`; nullopt when nothing registered it.
std::optional<double> CounterValue(const prometheus::Registry& registry, const std::string& name);

// The body of GET /metrics from the shard whose log is `log_path` (start it
// with --metrics-listen 127.0.0.1:0 and a log_dir: the last start in the
// log names its port); "" when there is none or it does not answer.
std::string ScrapeShard(const std::string& log_path);
// The sum of metric `name` over its label sets in that body; nullopt when
// the shard does not answer or has no such metric.
std::optional<double> ShardMetric(const std::string& log_path, const std::string& name);
// Polls ShardMetric every 10 ms until it is `value`, for at most `limit`:
// whether it came. For waiting on an event a shard counts (a stream
// parked) instead of sleeping through a window.
bool AwaitShardMetric(const std::string& log_path, const std::string& name, double value,
                      std::chrono::milliseconds limit = std::chrono::seconds(30));

// Writes `token` to DIR/token, readable by its owner only (the shard and the
// CLI refuse a token file others may read); returns the path.
std::string WriteAdminToken(const std::string& dir, const std::string& token);

// Runs `command` through the shell; returns its exit status and fills
// `output` with stdout and stderr together.
int RunCommand(const std::string& command, std::string* output);

// Whether a waitpid(2) status is a death by SIGKILL, as a failpoint kills
// (platform/failpoint.cc); not by another signal, not an exit.
bool KilledBySigkill(int wait_status);

// How a process ended, from its waitpid(2) status: "exit status 1",
// "signal 6 (Aborted)".
std::string DescribeWaitStatus(int wait_status);

}  // namespace layercast::testing
