#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "platform/file_system.h"

namespace layercast::fuzz {

// A read-only FileSystem over byte strings held in memory, so a fuzz target
// can hand SafetensorsReader its input without touching the disk. Files are
// added with Add() before use; writes are refused. Not thread-safe while
// files are added; reads may run concurrently afterwards.
class MemoryFileSystem final : public FileSystem {
 public:
  // Serves `bytes` at `path` with `permissions` (what a umask of 022 gives
  // root by default); the bytes are referenced, not copied, and must outlive
  // every file opened from them.
  void Add(const std::string& path, absl::string_view bytes,
           FilePermissions permissions = {.mode = 0644, .owner_uid = 0}) {
    files_[path] = {bytes, permissions};
  }

  // The bytes served at `path`, or nullptr.
  const absl::string_view* Find(const std::string& path) const {
    const auto it = files_.find(path);
    return it == files_.end() ? nullptr : &it->second.bytes;
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    const auto it = files_.find(path);
    if (it == files_.end())
      return absl::NotFoundError(absl::StrCat("open '", path, "': no such file"));
    return std::make_unique<File>(path, it->second);
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const std::string& path) override {
    return absl::PermissionDeniedError(absl::StrCat("open '", path, "' for writing: read-only"));
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> CreatePrivate(const std::string& path) override {
    return absl::PermissionDeniedError(absl::StrCat("create '", path, "': read-only"));
  }
  absl::Status Rename(const std::string& from, const std::string&) override {
    return absl::PermissionDeniedError(absl::StrCat("rename '", from, "': read-only"));
  }
  absl::Status SyncDir(const std::string&) override { return absl::OkStatus(); }
  absl::Status Remove(const std::string& path) override {
    return absl::PermissionDeniedError(absl::StrCat("remove '", path, "': read-only"));
  }
  bool Exists(const std::string& path) override { return Find(path) != nullptr; }

 private:
  struct Entry {
    absl::string_view bytes;
    FilePermissions permissions;
  };

  class File final : public RandomAccessFile {
   public:
    File(std::string path, const Entry& entry)
        : path_(std::move(path)), bytes_(entry.bytes), permissions_(entry.permissions) {}
    uint64_t size() const override { return bytes_.size(); }
    const std::string& path() const override { return path_; }
    FilePermissions permissions() const override { return permissions_; }
    absl::Status ReadAt(uint64_t offset, std::span<uint8_t> out) const override {
      uint64_t end = 0;
      if (__builtin_add_overflow(offset, out.size(), &end) || end > bytes_.size()) {
        return absl::OutOfRangeError(absl::StrCat("read of ", out.size(), " bytes at offset ",
                                                  offset, " from '", path_, "': the file has only ",
                                                  bytes_.size(), " bytes"));
      }
      if (!out.empty()) std::memcpy(out.data(), bytes_.data() + offset, out.size());
      return absl::OkStatus();
    }

   private:
    const std::string path_;
    const absl::string_view bytes_;
    const FilePermissions permissions_;
  };

  std::map<std::string, Entry> files_;
};

}  // namespace layercast::fuzz
