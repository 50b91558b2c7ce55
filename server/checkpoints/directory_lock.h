#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace layercast::server {

// An advisory lock on one file in a directory, held by this process until
// the object is destroyed (or the process dies: the kernel drops it, so a
// crashed shard never leaves it behind). Two shards started with the same
// --shard-index and --checkpoint-dir would write one checkpoint file;
// the second refuses to start instead, naming the first.
//
// Hand-written on flock(2): the lock must name the process that holds it,
// which no library here offers. Move-only.
class DirectoryLock {
 public:
  // Locks `path` (created if missing, mode 0600) and writes this process
  // id into it. FAILED_PRECONDITION naming the holder's process id when
  // another open of the file holds it; `what` says what the lock guards,
  // for the message; the system's code when the file cannot be opened.
  static absl::StatusOr<DirectoryLock> Acquire(const std::string& path, const std::string& what);

  DirectoryLock(DirectoryLock&& other) noexcept;
  DirectoryLock& operator=(DirectoryLock&& other) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  ~DirectoryLock();

  const std::string& path() const { return path_; }

 private:
  DirectoryLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

}  // namespace layercast::server
