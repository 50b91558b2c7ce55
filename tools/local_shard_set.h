#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace layercast::tools {

// N real `layercast-shard` processes on 127.0.0.1, each on a port of its own
// choosing: what `layercast demo`, the benchmarks and the integration tests
// run against. Not part of the worker library: a worker connects to shards
// someone else runs. Stop() (or the destructor) sends SIGTERM and waits; a
// shard that does not exit within the grace period is killed. The shards'
// port files go in a fresh directory under the system's temporary directory
// ($TMPDIR or /tmp), removed with the set.
//
// The methods ending in ForTest break or restart shards on purpose, for the
// fault tests; nothing else should call them.
//
// Not thread-safe.
class LocalShardSet {
 public:
  struct Options {
    std::string shard_binary;  // path to layercast-shard
    uint32_t num_shards = 2;
    // Flags passed to every shard besides --listen, --port-file,
    // --shard-index, --num-shards and --peers-file (the set's addresses,
    // for settling publishes), e.g. {"--synthetic", "llama:"}.
    std::vector<std::string> extra_flags;
    std::chrono::milliseconds start_timeout{60000};
    // Where shards' stderr goes; empty: inherited.
    std::string log_dir;
    // Flags for one shard only, after extra_flags (the last of a flag
    // given twice counts), by shard index.
    std::map<uint32_t, std::vector<std::string>> shard_flags;
    // NAME=VALUE entries added to the shards' environment (e.g. the fault
    // tests' LAYERCAST_FAILPOINT), besides this process's own.
    std::vector<std::string> environment;
  };

  // Starts every shard and waits until each has written its port file (it is
  // listening; it may still be loading). FAILED_PRECONDITION with the shard's
  // exit status if one exits first.
  static absl::StatusOr<std::unique_ptr<LocalShardSet>> Start(Options options);
  ~LocalShardSet();

  // "127.0.0.1:PORT" of each shard, in shard order.
  const std::vector<std::string>& addresses() const { return addresses_; }
  pid_t pid(size_t shard) const { return pids_[shard]; }

  // Peak resident memory (VmHWM) of shard `shard` in bytes; 0 if unknown.
  uint64_t PeakRssBytes(size_t shard) const;

  // Sends SIGKILL to one shard, as a crash would, and reaps it.
  void KillForTest(size_t shard);

  // Starts shard `shard` again (after Kill or exit) with the same flags on
  // the same port, as a restarted pod would come back; returns once it
  // listens. The old process must have been reaped.
  absl::Status RestartForTest(size_t shard,
                              std::chrono::milliseconds timeout = std::chrono::seconds(60));

  // Sends `signal` to one shard without waiting.
  void SignalForTest(size_t shard, int signal);

  // Waits up to `timeout` for one shard to exit and reaps it: its exit code,
  // or 128 + the signal that ended it; its waitpid(2) status in
  // `*wait_status` when given (to tell a signal from an exit code).
  // DEADLINE_EXCEEDED if it is still running (it is left running).
  absl::StatusOr<int> WaitForExitForTest(size_t shard, std::chrono::milliseconds timeout,
                                         int* wait_status = nullptr);

  // SIGTERM to every live shard, then waits up to `grace` for each. OK if
  // every shard exited 0; otherwise an error naming the first that did not.
  absl::Status Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(15000));

 private:
  LocalShardSet() = default;
  // Spawns shard `shard` listening on `listen`; returns its pid.
  absl::StatusOr<pid_t> Spawn(uint32_t shard, const std::string& listen);
  // Writes every shard's address to the file each shard reads as its
  // --peers-file, once all listen (their ports are their own choice).
  absl::Status WritePeers() const;
  // Waits for shard `shard`'s port file; fills addresses_[shard].
  absl::Status AwaitPort(uint32_t shard, std::chrono::steady_clock::time_point deadline);

  Options options_;
  std::string temp_dir_;
  std::vector<pid_t> pids_;
  std::vector<std::string> addresses_;
};

// Peak resident memory (VmHWM) of process `pid` (0: this process), bytes.
uint64_t PeakRssBytes(pid_t pid = 0);

// The layercast-shard binary next to the running executable, if there is one.
std::string DefaultShardBinary();

}  // namespace layercast::tools
