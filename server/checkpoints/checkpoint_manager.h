#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "platform/file_system.h"
#include "server/checkpoints/checkpoint_writer.h"
#include "server/checkpoints/directory_lock.h"
#include "server/serving/parameter_store.h"

namespace layercast::server {

// The checkpoint of one shard in one directory (--checkpoint-dir): finding
// the file to start from, writing new ones one at a time, and remembering
// which version the file holds.
//
// Thread-safe.
class CheckpointManager {
 public:
  // NOT_FOUND unless `dir` exists. Holds DIR/shard-<index>.lock while it
  // lives: FAILED_PRECONDITION, naming the other process, when a live one
  // holds it (DirectoryLock). `fs` must outlive the manager.
  static absl::StatusOr<std::unique_ptr<CheckpointManager>> Create(
      std::string dir, uint32_t shard_index, uint32_t num_shards,
      FileSystem& fs = DefaultFileSystem());

  // This shard's checkpoint file (it may not exist).
  const std::string& path() const { return path_; }
  const std::string& dir() const { return dir_; }

  // The checkpoint to start from: path() if it exists, nullopt if the
  // directory holds none for this shard.
  absl::StatusOr<std::optional<std::string>> FindExisting() const;
  // When the directory holds no checkpoint of this shard (FindExisting):
  // the shard count N of the checkpoints another count wrote there, which
  // this shard loads resharded (ReshardedCheckpoint); nullopt when there
  // are none. FAILED_PRECONDITION, naming the files, when that is not one
  // set: checkpoints of two other counts, or of this count for other
  // indexes beside another count's (starting from either would leave the
  // set at two different steps).
  absl::StatusOr<std::optional<uint32_t>> FindReshardSource() const;

  // Removes this shard's temporary files left by writes that a crash
  // interrupted (those of this process id, or of processes no longer
  // running; a symbolic link at such a name is removed, never followed);
  // returns how many. Nothing ever reads them.
  int RemoveStaleTemporaries();

  // Records that path() holds `version` (it was just loaded from it).
  void NoteOnDisk(uint64_t version);
  // True if path() exists and this process wrote or loaded it at `version`.
  bool HoldsVersion(uint64_t version) const;

  // Writes `store` at `version` (WriteCheckpoint), after any write in
  // progress.
  absl::StatusOr<CheckpointInfo> Write(const ParameterStore& store, uint64_t version,
                                       const CheckpointExtras& extras = {});
  // As Write, but ABORTED at once while another write is in progress.
  absl::StatusOr<CheckpointInfo> TryWrite(const ParameterStore& store, uint64_t version,
                                          const CheckpointExtras& extras = {});

 private:
  CheckpointManager(std::string dir, uint32_t shard_index, uint32_t num_shards, FileSystem& fs,
                    DirectoryLock lock);
  absl::StatusOr<CheckpointInfo> WriteLocked(const ParameterStore& store, uint64_t version,
                                             const CheckpointExtras& extras)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);

  const std::string dir_;
  const uint32_t shard_index_;
  const uint32_t num_shards_;
  const std::string path_;
  FileSystem& fs_;
  const DirectoryLock lock_;
  // Held for the whole of a write.
  absl::Mutex write_mu_;
  mutable absl::Mutex mu_;
  std::optional<uint64_t> on_disk_version_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::server
