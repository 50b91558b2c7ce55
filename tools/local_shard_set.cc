#include "tools/local_shard_set.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "platform/status_macros.h"

extern char** environ;

namespace layercast::tools {
namespace {

std::string DescribeExit(int wait_status) {
  if (WIFEXITED(wait_status)) return absl::StrCat("exit status ", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) return absl::StrCat("signal ", WTERMSIG(wait_status));
  return "unknown status";
}

// Waits for `pid` until `deadline`; true and its status once it has exited.
bool WaitUntil(pid_t pid, std::chrono::steady_clock::time_point deadline, int* wait_status) {
  while (true) {
    const pid_t done = waitpid(pid, wait_status, WNOHANG);
    if (done == pid || done < 0) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

uint64_t PeakRssBytes(pid_t pid) {
  std::ifstream status(pid == 0 ? std::string("/proc/self/status")
                                : absl::StrCat("/proc/", pid, "/status"));
  std::string key;
  while (status >> key) {
    if (key == "VmHWM:") {
      uint64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
    status.ignore(1 << 20, '\n');
  }
  return 0;
}

std::string DefaultShardBinary() {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) return "layercast-shard";
  return (self.parent_path() / "layercast-shard").string();
}

absl::StatusOr<pid_t> LocalShardSet::Spawn(uint32_t shard, const std::string& listen) {
  const std::string port_file = absl::StrCat(temp_dir_, "/shard-", shard, ".port");
  std::remove(port_file.c_str());
  std::vector<std::string> args = {options_.shard_binary, "--listen", listen, "--port-file",
                                   port_file, "--shard-index", absl::StrCat(shard), "--num-shards",
                                   absl::StrCat(options_.num_shards), "--peers-file",
                                   absl::StrCat(temp_dir_, "/peers"),
                                   // Loopback only: the network is this host's.
                                   "--peers-insecure", "true"};
  args.insert(args.end(), options_.extra_flags.begin(), options_.extra_flags.end());
  if (auto own = options_.shard_flags.find(shard); own != options_.shard_flags.end()) {
    args.insert(args.end(), own->second.begin(), own->second.end());
  }
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  // The shard must not hold the caller's pipes and sockets open.
  posix_spawn_file_actions_addclosefrom_np(&actions, STDERR_FILENO + 1);
  if (!options_.log_dir.empty()) {
    const std::string log = absl::StrCat(options_.log_dir, "/shard-", shard, ".log");
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
  }
  std::vector<char*> envp;
  for (char** entry = environ; *entry != nullptr; ++entry) envp.push_back(*entry);
  for (std::string& entry : options_.environment) envp.push_back(entry.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  const int error = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) {
    return absl::InternalError(
        absl::StrCat("cannot start ", options_.shard_binary, ": ", std::strerror(error)));
  }
  return pid;
}

absl::Status LocalShardSet::AwaitPort(uint32_t shard,
                                      std::chrono::steady_clock::time_point deadline) {
  const std::string port_file = absl::StrCat(temp_dir_, "/shard-", shard, ".port");
  int port = 0;
  while (true) {
    std::ifstream(port_file) >> port;
    if (port != 0) break;
    int wait_status = 0;
    if (waitpid(pids_[shard], &wait_status, WNOHANG) == pids_[shard]) {
      pids_[shard] = 0;
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", shard, " exited before listening (", DescribeExit(wait_status), ")"));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("shard ", shard, " did not start listening in time"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  addresses_[shard] = absl::StrCat("127.0.0.1:", port);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<LocalShardSet>> LocalShardSet::Start(Options options) {
  if (access(options.shard_binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("shard binary ", options.shard_binary,
                                            " is not an executable file; build layercast-shard "
                                            "or pass its path"));
  }
  auto set = std::unique_ptr<LocalShardSet>(new LocalShardSet());
  set->options_ = std::move(options);
  // The system's temporary directory ($TMPDIR, else /tmp), as mkdtemp(3)
  // callers are expected to honour.
  std::error_code error;
  std::string dir_template =
      (std::filesystem::temp_directory_path(error) / "layercast-shards-XXXXXX").string();
  if (error || mkdtemp(dir_template.data()) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot create a directory for the shards' port files from ", dir_template, ": ",
        error ? error.message() : std::strerror(errno), "; set TMPDIR to a writable directory"));
  }
  set->temp_dir_ = dir_template;
  const uint32_t n = set->options_.num_shards;
  set->addresses_.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    ASSIGN_OR_RETURN(pid_t pid, set->Spawn(i, "127.0.0.1:0"));
    set->pids_.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + set->options_.start_timeout;
  for (uint32_t i = 0; i < n; ++i) RETURN_IF_ERROR(set->AwaitPort(i, deadline));
  RETURN_IF_ERROR(set->WritePeers());
  return set;
}

absl::Status LocalShardSet::WritePeers() const {
  // Written whole, then renamed: a shard reading it never sees part of it.
  const std::string path = absl::StrCat(temp_dir_, "/peers");
  const std::string partial = path + ".partial";
  {
    std::ofstream file(partial);
    for (const std::string& address : addresses_) file << address << "\n";
    if (!file.flush()) {
      return absl::InternalError(absl::StrCat("cannot write the shards' peer list ", partial));
    }
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot rename ", partial, " to ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status LocalShardSet::RestartForTest(size_t shard, std::chrono::milliseconds timeout) {
  if (pids_[shard] > 0) {
    return absl::FailedPreconditionError(absl::StrCat("shard ", shard, " is still running"));
  }
  ASSIGN_OR_RETURN(pids_[shard], Spawn(static_cast<uint32_t>(shard), addresses_[shard]));
  return AwaitPort(static_cast<uint32_t>(shard), std::chrono::steady_clock::now() + timeout);
}

LocalShardSet::~LocalShardSet() {
  (void)Stop(std::chrono::milliseconds(5000));
  std::error_code ignored;
  if (!temp_dir_.empty()) std::filesystem::remove_all(temp_dir_, ignored);
}

uint64_t LocalShardSet::PeakRssBytes(size_t shard) const {
  return pids_[shard] > 0 ? tools::PeakRssBytes(pids_[shard]) : 0;
}

void LocalShardSet::KillForTest(size_t shard) {
  if (pids_[shard] <= 0) return;
  kill(pids_[shard], SIGKILL);
  int wait_status = 0;
  waitpid(pids_[shard], &wait_status, 0);
  pids_[shard] = 0;
}

void LocalShardSet::SignalForTest(size_t shard, int signal) {
  if (pids_[shard] > 0) kill(pids_[shard], signal);
}

absl::StatusOr<int> LocalShardSet::WaitForExitForTest(size_t shard,
                                                      std::chrono::milliseconds timeout,
                                                      int* wait_status) {
  if (pids_[shard] <= 0) return absl::FailedPreconditionError("that shard was already reaped");
  int status = 0;
  if (!WaitUntil(pids_[shard], std::chrono::steady_clock::now() + timeout, &status)) {
    return absl::DeadlineExceededError(
        absl::StrCat("shard ", shard, " still running after ", timeout.count(), " ms"));
  }
  pids_[shard] = 0;
  if (wait_status != nullptr) *wait_status = status;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

absl::Status LocalShardSet::Stop(std::chrono::milliseconds grace) {
  for (pid_t pid : pids_) {
    if (pid > 0) kill(pid, SIGTERM);
  }
  absl::Status result;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (size_t i = 0; i < pids_.size(); ++i) {
    if (pids_[i] <= 0) continue;
    int wait_status = 0;
    if (!WaitUntil(pids_[i], deadline, &wait_status)) {
      kill(pids_[i], SIGKILL);
      waitpid(pids_[i], &wait_status, 0);
      if (result.ok()) {
        result = absl::DeadlineExceededError(
            absl::StrCat("shard ", i, " did not stop within ", grace.count(), " ms; killed"));
      }
    } else if (result.ok() && !(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0)) {
      result = absl::InternalError(
          absl::StrCat("shard ", i, " stopped with ", DescribeExit(wait_status)));
    }
    pids_[i] = 0;
  }
  return result;
}

}  // namespace layercast::tools
