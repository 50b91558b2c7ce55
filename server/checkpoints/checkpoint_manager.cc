#include "server/checkpoints/checkpoint_manager.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <filesystem>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"

namespace layercast::server {

CheckpointManager::CheckpointManager(std::string dir, uint32_t shard_index, uint32_t num_shards,
                                     FileSystem& fs, DirectoryLock lock)
    : dir_(std::move(dir)),
      shard_index_(shard_index),
      num_shards_(num_shards),
      path_(CheckpointPath(dir_, shard_index, num_shards)),
      fs_(fs),
      lock_(std::move(lock)) {}

absl::StatusOr<std::unique_ptr<CheckpointManager>> CheckpointManager::Create(std::string dir,
                                                                             uint32_t shard_index,
                                                                             uint32_t num_shards,
                                                                             FileSystem& fs) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty() || !fs.Exists(dir)) {
    return absl::NotFoundError(
        absl::StrCat("--checkpoint-dir '", dir,
                     "' does not exist: create it, on storage that outlives the process"));
  }
  // The lock is the file system's, not the FileSystem seam's: no test
  // double needs it.
  ASSIGN_OR_RETURN(DirectoryLock lock,
                   DirectoryLock::Acquire(absl::StrCat(dir, "/shard-", shard_index, ".lock"),
                                          absl::StrCat("shard index ", shard_index, " of ", dir)));
  return std::unique_ptr<CheckpointManager>(
      new CheckpointManager(std::move(dir), shard_index, num_shards, fs, std::move(lock)));
}

// Listing a directory is not part of the FileSystem seam (nothing else needs
// it); the scans below use std::filesystem and only ever read names.
absl::StatusOr<std::optional<std::string>> CheckpointManager::FindExisting() const {
  if (!fs_.Exists(path_)) return std::nullopt;
  return path_;
}

absl::StatusOr<std::optional<uint32_t>> CheckpointManager::FindReshardSource() const {
  std::set<uint32_t> counts;
  std::optional<std::string> own_count;  // a file of this count, another index
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, error)) {
    const std::string name = entry.path().filename().string();
    const auto parsed = ParseCheckpointFileName(name);
    if (!parsed) continue;
    if (parsed->second == num_shards_) {
      own_count = name;
    } else {
      counts.insert(parsed->second);
    }
  }
  if (error) {
    return absl::Status(absl::ErrnoToStatusCode(error.value()),
                        absl::StrCat("cannot list --checkpoint-dir ", dir_, ": ", error.message()));
  }
  if (counts.empty()) return std::nullopt;
  if (counts.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--checkpoint-dir ", dir_, " holds checkpoints of ", absl::StrJoin(counts, " and "),
        " shards and none of shard ", shard_index_, " of ", num_shards_,
        ": which to load is not clear; move all but one set away"));
  }
  if (own_count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--checkpoint-dir ", dir_, " holds ", *own_count, " but not ",
        CheckpointFileName(shard_index_, num_shards_), ", beside the checkpoints of ",
        *counts.begin(),
        " shards: this shard would start from those while the others start from their own; put "
        "its file back, or move the shard-*-of-",
        num_shards_, " files away to load the ", *counts.begin(), " shards' set"));
  }
  return *counts.begin();
}

int CheckpointManager::RemoveStaleTemporaries() {
  const std::string prefix =
      absl::StrCat(".", CheckpointFileName(shard_index_, num_shards_), ".tmp-");
  int removed = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, error)) {
    const std::string name = entry.path().filename().string();
    if (!absl::StartsWith(name, prefix)) continue;
    // "<pid>-<nonce>" (TempCheckpointPath), or "<pid>" alone as versions
    // before the nonce named them.
    int64_t pid = 0;
    const char* begin = name.data() + prefix.size();
    const char* end = name.data() + name.size();
    auto [pid_end, ec] = std::from_chars(begin, end, pid);
    if (pid_end == begin || ec != std::errc() || pid <= 0) continue;
    if (pid_end != end) {
      const absl::string_view nonce(pid_end + 1, static_cast<size_t>(end - pid_end) - 1);
      if (*pid_end != '-' || nonce.empty() ||
          !std::all_of(nonce.begin(), nonce.end(), absl::ascii_isxdigit)) {
        continue;
      }
    }
    // Our own id (a restarted container is often pid 1 again), or a process
    // that no longer runs: no write is in progress there.
    const bool gone = pid == getpid() || (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH);
    if (gone && fs_.Remove(entry.path().string()).ok()) ++removed;
  }
  return removed;
}

void CheckpointManager::NoteOnDisk(uint64_t version) {
  absl::MutexLock lock(&mu_);
  on_disk_version_ = version;
}

bool CheckpointManager::HoldsVersion(uint64_t version) const {
  {
    absl::MutexLock lock(&mu_);
    if (on_disk_version_ != version) return false;
  }
  return fs_.Exists(path_);
}

absl::StatusOr<CheckpointInfo> CheckpointManager::Write(const ParameterStore& store,
                                                        uint64_t version,
                                                        const CheckpointExtras& extras) {
  absl::MutexLock lock(&write_mu_);
  return WriteLocked(store, version, extras);
}

absl::StatusOr<CheckpointInfo> CheckpointManager::TryWrite(const ParameterStore& store,
                                                           uint64_t version,
                                                           const CheckpointExtras& extras) {
  if (!write_mu_.TryLock()) {
    return absl::AbortedError(absl::StrCat("a checkpoint of this shard is being written to ", path_,
                                           "; wait for it to finish and retry"));
  }
  absl::StatusOr<CheckpointInfo> info = WriteLocked(store, version, extras);
  write_mu_.Unlock();
  return info;
}

absl::StatusOr<CheckpointInfo> CheckpointManager::WriteLocked(const ParameterStore& store,
                                                              uint64_t version,
                                                              const CheckpointExtras& extras) {
  {
    // Whatever happens next, the file may no longer hold the old version.
    absl::MutexLock lock(&mu_);
    on_disk_version_.reset();
  }
  absl::StatusOr<CheckpointInfo> info = WriteCheckpoint(store, version, dir_, fs_, extras);
  if (info.ok()) {
    absl::MutexLock lock(&mu_);
    on_disk_version_ = version;
  }
  return info;
}

}  // namespace layercast::server
