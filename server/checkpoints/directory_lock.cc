#include "server/checkpoints/directory_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace layercast::server {
namespace {

// What the holder wrote into the file: its process id, or "" if it could
// not be read.
std::string HolderOf(int fd) {
  char buffer[32] = {};
  const ssize_t got = pread(fd, buffer, sizeof(buffer) - 1, 0);
  if (got <= 0) return "";
  return std::string(absl::StripAsciiWhitespace(std::string(buffer, static_cast<size_t>(got))));
}

}  // namespace

absl::StatusOr<DirectoryLock> DirectoryLock::Acquire(const std::string& path,
                                                     const std::string& what) {
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    const int error = errno;
    return absl::Status(
        absl::ErrnoToStatusCode(error),
        absl::StrCat("cannot open the lock file ", path, " of ", what, ": ", std::strerror(error)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    const std::string holder = HolderOf(fd);
    close(fd);
    if (error == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "another live process", holder.empty() ? "" : absl::StrCat(" (pid ", holder, ")"),
          " holds ", path, ": it already serves ", what,
          ", and two processes would write one checkpoint file. Stop it first, or give this "
          "shard its own --shard-index or --checkpoint-dir"));
    }
    return absl::Status(absl::ErrnoToStatusCode(error),
                        absl::StrCat("cannot lock ", path, ": ", std::strerror(error)));
  }
  const std::string pid = absl::StrCat(getpid(), "\n");
  // Best effort: the pid only names the holder in another process's message.
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) < 0) {
    // The lock itself is held; a missing pid only makes the message vaguer.
  }
  return DirectoryLock(path, fd);
}

DirectoryLock::DirectoryLock(DirectoryLock&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

DirectoryLock& DirectoryLock::operator=(DirectoryLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

DirectoryLock::~DirectoryLock() {
  // Closing the only descriptor of the open file drops the lock.
  if (fd_ >= 0) close(fd_);
}

}  // namespace layercast::server
