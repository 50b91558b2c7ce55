#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace layercast {

// The one seam between layercast and files. Real by default
// (DefaultFileSystem()); tests wrap it to inject faults. Errors are statuses
// whose messages name the path and the failing operation.

// Who may do what with a file, as stat(2) reports it.
struct FilePermissions {
  uint32_t mode = 0;       // the permission bits, st_mode & 07777 (e.g. 0600)
  uint32_t owner_uid = 0;  // st_uid
};

// A file opened for positioned reads. Thread-safe: ReadAt may be called
// concurrently.
class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  // Size in bytes when opened.
  virtual uint64_t size() const = 0;
  // Reads exactly out.size() bytes at `offset`; OUT_OF_RANGE if the file ends
  // first.
  virtual absl::Status ReadAt(uint64_t offset, std::span<uint8_t> out) const = 0;
  virtual const std::string& path() const = 0;
  // Its permissions when opened: those of the file being read, not of
  // whatever the path names later.
  virtual FilePermissions permissions() const = 0;
};

// A file opened for sequential writes. Not thread-safe.
class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual absl::Status Append(std::span<const uint8_t> data) = 0;
  // Flushes to stable storage (fsync).
  virtual absl::Status Sync() = 0;
  virtual absl::Status Close() = 0;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(
      const std::string& path) = 0;
  // Creates (mode 0644 less the umask) or truncates `path`, following a
  // symbolic link there.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const std::string& path) = 0;
  // Creates `path` as a new file that only its owner may read or write
  // (0600), for contents others must neither read nor redirect: ALREADY_EXISTS
  // if anything is at `path`, a symbolic link included (dangling or not),
  // which is never followed.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> CreatePrivate(const std::string& path) = 0;
  // Atomically replaces `to` with `from` (rename(2)).
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  // Makes a directory's entries durable (fsync of the directory).
  virtual absl::Status SyncDir(const std::string& dir) = 0;
  virtual absl::Status Remove(const std::string& path) = 0;
  virtual bool Exists(const std::string& path) = 0;
};

// The process-wide POSIX file system. Never destroyed.
FileSystem& DefaultFileSystem();

}  // namespace layercast
