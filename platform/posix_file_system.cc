// DefaultFileSystem(): the POSIX implementation of the file seam.
//
// Every syscall that can be interrupted by a signal is retried on EINTR, and
// every partial read/write is continued, so callers see either the whole
// transfer or a status. Messages name the operation, the path and strerror.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "platform/file_system.h"

namespace layercast {
namespace {

// glibc exposes the GNU strerror_r (returns char*), other libcs the XSI one
// (returns int); these overloads accept either so the code is portable and
// thread-safe (strerror is not).
[[maybe_unused]] std::string StrErrorResult(const char* gnu_result, const char*) {
  return gnu_result;
}
[[maybe_unused]] std::string StrErrorResult(int xsi_result, const char* buf) {
  return xsi_result == 0 ? std::string(buf) : std::string("unknown error");
}

std::string StrError(int errnum) {
  char buf[256] = {};
  return StrErrorResult(strerror_r(errnum, buf, sizeof(buf)), buf);
}

// A status for a failed syscall: the code follows errno (ENOENT -> NOT_FOUND,
// EACCES -> PERMISSION_DENIED, ...), the message says what was being done.
absl::Status ErrnoError(int errnum, const std::string& operation, const std::string& path) {
  return absl::Status(absl::ErrnoToStatusCode(errnum),
                      absl::StrCat(operation, " '", path, "': ", StrError(errnum)));
}

class PosixRandomAccessFile final : public RandomAccessFile {
 public:
  PosixRandomAccessFile(std::string path, int fd, uint64_t size, FilePermissions permissions)
      : path_(std::move(path)), fd_(fd), size_(size), permissions_(permissions) {}
  ~PosixRandomAccessFile() override { close(fd_); }
  PosixRandomAccessFile(const PosixRandomAccessFile&) = delete;
  PosixRandomAccessFile& operator=(const PosixRandomAccessFile&) = delete;

  uint64_t size() const override { return size_; }
  const std::string& path() const override { return path_; }
  FilePermissions permissions() const override { return permissions_; }

  absl::Status ReadAt(uint64_t offset, std::span<uint8_t> out) const override {
    uint64_t end = 0;
    if (__builtin_add_overflow(offset, out.size(), &end) || end > size_) {
      return absl::OutOfRangeError(absl::StrCat("read of ", out.size(), " bytes at offset ", offset,
                                                " from '", path_, "': the file has only ", size_,
                                                " bytes"));
    }
    size_t done = 0;
    while (done < out.size()) {
      // pread takes off_t (signed); `end <= size_` keeps this in range.
      const ssize_t n =
          pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoError(errno, absl::StrCat("pread at offset ", offset + done, " of"), path_);
      }
      if (n == 0) {
        // The file shrank after it was opened.
        return absl::OutOfRangeError(absl::StrCat("read of ", out.size(), " bytes at offset ",
                                                  offset, " from '", path_, "': end of file after ",
                                                  done, " bytes"));
      }
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

 private:
  const std::string path_;
  const int fd_;
  const uint64_t size_;
  const FilePermissions permissions_;
};

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) close(fd_);
  }
  PosixWritableFile(const PosixWritableFile&) = delete;
  PosixWritableFile& operator=(const PosixWritableFile&) = delete;

  absl::Status Append(std::span<const uint8_t> data) override {
    if (fd_ < 0) return ClosedError("write");
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t n = write(fd_, data.data() + done, data.size() - done);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoError(errno, "write to", path_);
      }
      done += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    if (fd_ < 0) return ClosedError("fsync");
    while (fsync(fd_) != 0) {
      if (errno != EINTR) return ErrnoError(errno, "fsync", path_);
    }
    return absl::OkStatus();
  }

  absl::Status Close() override {
    if (fd_ < 0) return ClosedError("close");
    const int fd = fd_;
    fd_ = -1;
    // Linux releases the descriptor even when close fails (EINTR included), so
    // retrying could close a descriptor another thread just opened.
    if (close(fd) != 0) return ErrnoError(errno, "close", path_);
    return absl::OkStatus();
  }

 private:
  absl::Status ClosedError(const char* operation) const {
    return absl::FailedPreconditionError(
        absl::StrCat(operation, " '", path_, "': the file is already closed"));
  }

  const std::string path_;
  int fd_;
};

class PosixFileSystem final : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    int fd;
    do {
      fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return ErrnoError(errno, "open for reading", path);
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      close(fd);
      return ErrnoError(err, "fstat", path);
    }
    if (S_ISDIR(st.st_mode)) {
      close(fd);
      return ErrnoError(EISDIR, "open for reading", path);
    }
    return std::make_unique<PosixRandomAccessFile>(
        path, fd, static_cast<uint64_t>(st.st_size),
        FilePermissions{.mode = static_cast<uint32_t>(st.st_mode & 07777),
                        .owner_uid = static_cast<uint32_t>(st.st_uid)});
  }

  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const std::string& path) override {
    int fd;
    do {
      fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return ErrnoError(errno, "open for writing", path);
    return std::make_unique<PosixWritableFile>(path, fd);
  }

  absl::StatusOr<std::unique_ptr<WritableFile>> CreatePrivate(const std::string& path) override {
    // O_EXCL fails on any existing name, a symbolic link included (POSIX:
    // "regardless of the contents of the symbolic link"); O_NOFOLLOW says the
    // same for a reader who does not know that. The umask can only clear
    // bits, so the file is at most 0600 whatever it is.
    int fd;
    do {
      fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return ErrnoError(errno, "create (new, owner only)", path);
    return std::make_unique<PosixWritableFile>(path, fd);
  }

  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoError(errno, absl::StrCat("rename to '", to, "' of"), from);
    }
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& dir) override {
    int fd;
    do {
      fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return ErrnoError(errno, "open directory", dir);
    absl::Status status;
    while (fsync(fd) != 0) {
      if (errno != EINTR) {
        status = ErrnoError(errno, "fsync directory", dir);
        break;
      }
    }
    close(fd);
    return status;
  }

  absl::Status Remove(const std::string& path) override {
    if (unlink(path.c_str()) != 0) return ErrnoError(errno, "unlink", path);
    return absl::OkStatus();
  }

  bool Exists(const std::string& path) override {
    struct stat st;
    return stat(path.c_str(), &st) == 0;
  }
};

}  // namespace

FileSystem& DefaultFileSystem() {
  // Leaked on purpose: files may be used from static destructors elsewhere.
  static FileSystem* const fs = new PosixFileSystem();
  return *fs;
}

}  // namespace layercast
