#pragma once

#include <map>
#include <span>
#include <utility>
#include <vector>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "platform/file_system.h"
#include "server/serving/parameter_store.h"

namespace layercast::server {

// What one checkpoint write produced.
struct CheckpointInfo {
  std::string path;      // the checkpoint file
  uint64_t bytes = 0;    // its size: header and data
  uint64_t version = 0;  // parameter version it holds
  double seconds = 0;    // wall-clock time of the write, fsyncs included
  std::string checksum;  // "sha256:<hex>" of the data section
};

// What a training shard saves beside its master: metadata fields added to
// the header, and fp32 tensors written after the master's, in this order
// (the optimizer state: see checkpoint_format.h). The spans must stay valid
// and unchanged for the whole write.
struct CheckpointExtras {
  std::map<std::string, std::string> metadata;
  std::vector<std::pair<std::string, std::span<const float>>> tensors;
};

// Writes `store`'s fp32 master at parameter `version` as the checkpoint of
// its shard in `dir` (format: server/checkpoints/checkpoint_format.h), atomically and
// durably, through `fs` only:
//
//   1. compute the SHA-256 of the data (it goes in the header, which comes
//      first);
//   2. create `.shard-<i>-of-<N>.safetensors.tmp-<pid>-<random nonce>` new and
//      private (0600; FileSystem::CreatePrivate, which never follows or
//      reuses what is already there), write it and fsync it;
//   3. rename it to `shard-<i>-of-<N>.safetensors`, which so is 0600 too;
//   4. fsync `dir`.
//
// The data is hashed again as it is written; a file whose data does not
// hash to its header's checksum (the store changed between the passes) is
// ABORTED before step 3.
//
// A failure before step 3 leaves the previous checkpoint untouched and
// removes the temporary file if this call created it (best effort: a crash
// leaves it, and nothing reads it). A failure in step 4 is reported, though
// the new checkpoint is in place and complete: it may not survive a power
// loss.
//
// REQUIRES: `store` does not change during the call (the data is read twice);
// `dir` exists. Thread-compatible: one write per (dir, shard) at a time.
absl::StatusOr<CheckpointInfo> WriteCheckpoint(const ParameterStore& store, uint64_t version,
                                               const std::string& dir,
                                               FileSystem& fs = DefaultFileSystem(),
                                               const CheckpointExtras& extras = {});

}  // namespace layercast::server
