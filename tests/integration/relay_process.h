#pragma once

// RelayProcess: a real `layercast relay` process for the tests that need one
// (relay_test.cc, security_test.cc).

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tests/integration/shard_fixture.h"

extern char** environ;

namespace layercast::testing {

// A `layercast relay` process of `shards` (two), serving on 127.0.0.1,
// with `flags` besides and the failpoint `failpoint` armed (none if
// empty), to fire once: it creates fired() first. Killed at the end unless
// stopped or reaped before.
class RelayProcess {
 public:
  RelayProcess(const std::string& dir, const std::string& name,
               const std::vector<std::string>& shards, const std::string& failpoint,
               const std::vector<std::string>& flags = {}) {
    const std::string port_file = absl::StrCat(dir, "/", name, ".ports");
    log_ = absl::StrCat(dir, "/", name, ".log");
    std::vector<std::string> args = {CliBinary(),   "relay",
                                     "--shards",    absl::StrJoin(shards, ","),
                                     "--listen",    "127.0.0.1:0,127.0.0.1:0",
                                     "--port-file", port_file};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    fired_ = absl::StrCat(dir, "/", name, ".fired");
    if (!failpoint.empty()) {
      env.push_back("LAYERCAST_FAILPOINT=" + failpoint);
      env.push_back("LAYERCAST_FAILPOINT_ONCE=" + fired_);
    }
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addclosefrom_np(&actions, STDERR_FILENO + 1);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log_.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
    const int spawned = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (spawned != 0) {
      ADD_FAILURE() << "cannot start " << argv[0] << ": " << std::strerror(spawned);
      pid_ = 0;
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::error_code error;
    while (!std::filesystem::exists(port_file, error)) {
      if (std::chrono::steady_clock::now() > deadline || waitpid(pid_, nullptr, WNOHANG) == pid_) {
        ADD_FAILURE() << "the relay wrote no port file; see " << log_;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::ifstream in(port_file);
    std::string line;
    std::getline(in, line);
    addresses_ = absl::StrSplit(line, ',');
  }
  ~RelayProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }

  const std::vector<std::string>& addresses() const { return addresses_; }
  const std::string& log() const { return log_; }
  // 0 once reaped.
  pid_t pid() const { return pid_; }
  // The marker its failpoint creates as it fires.
  const std::string& fired() const { return fired_; }

  // Waits up to `timeout` for it to exit and reaps it: its waitpid(2)
  // status (KilledBySigkill: a failpoint's death); nullopt if it is still
  // running (it is left running) or was reaped before.
  std::optional<int> WaitForExit(std::chrono::seconds timeout) {
    if (pid_ <= 0) return std::nullopt;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) != pid_) {
      if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = 0;
    return status;
  }

  // SIGTERM, then waits up to `grace`: OK if it exited 0 (no leak, no
  // sanitizer report); otherwise how it ended (killed after `grace`).
  absl::Status Stop(std::chrono::seconds grace = std::chrono::seconds(15)) {
    if (pid_ <= 0) return absl::FailedPreconditionError("the relay was already reaped");
    kill(pid_, SIGTERM);
    const std::optional<int> status = WaitForExit(grace);
    if (!status.has_value()) {
      return absl::DeadlineExceededError(
          absl::StrCat("the relay did not stop within ", grace.count(), " s; see ", log_));
    }
    if (WIFEXITED(*status) && WEXITSTATUS(*status) == 0) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat("the relay stopped with ", DescribeWaitStatus(*status), "; see ", log_));
  }

 private:
  pid_t pid_ = 0;
  std::string log_;
  std::string fired_;
  std::vector<std::string> addresses_;
};

}  // namespace layercast::testing
