#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/policy.h"
#include "platform/file_system.h"
#include "server/checkpoints/checkpoint_source.h"
#include "server/checkpoints/checkpoint_state.h"

namespace layercast::server {

// Where one shard's slice of a layer's tensors and another shard count's
// shard's slice of them overlap: per tensor, `count` elements starting at
// element `element` of the tensor, at `from_offset` in the concatenation of
// the `from` shard's slices of the layer's tensors (manifest order: how a
// push, a journal record and a staged push lay a layer out) and at
// `to_offset` in the `to` shard's.
struct SliceOverlap {
  uint32_t tensor = 0;
  uint64_t element = 0;
  uint64_t from_offset = 0;
  uint64_t to_offset = 0;
  uint64_t count = 0;
};
std::vector<SliceOverlap> LayerOverlaps(const LayerSpec& layer, uint32_t from_shard,
                                        uint32_t from_count, uint32_t to_shard, uint32_t to_count);

// Shard j of M starting from the checkpoints N shards wrote (N != M): for
// every tensor, its own element range of the master and of every optimizer
// buffer, each read from the file(s) of the N that hold it, and only those
// bytes (the shard math, ShardElementRange, says which file holds which
// range); the N files' versions, step counts and clip state, which must
// agree; and the pushes staged for open steps, cut to this shard's ranges.
//
// Open() reads the header of every one of the N files: a missing one, or
// one that does not match the model, layout, fingerprint or the others'
// versions, refuses the start with one line. VerifyChecksum() checks the
// block checksums of the blocks this shard read (block_crc32c), reading
// only those; a file written before block checksums is checked whole, by
// its SHA-256.
//
// A staged push that not every overlapping file holds (the old set died
// while a worker's push reached some shards and not others: the worker was
// never told it was taken, and pushes it again) is left out. A reduced mean
// that some of the overlapping files hold and others do not cannot be cut:
// FAILED_PRECONDITION, naming what to do.
//
// Thread-safe: Read and ReadState may run concurrently.
class ReshardedCheckpoint final : public CheckpointState {
 public:
  // `fs` must outlive the checkpoint.
  static absl::StatusOr<std::unique_ptr<ReshardedCheckpoint>> Open(
      const std::string& dir, uint32_t from_count, const ModelSpec& model, uint32_t shard_index,
      uint32_t num_shards, const Policy& policy,
      std::optional<ContentFingerprint> lineage = std::nullopt,
      FileSystem& fs = DefaultFileSystem());

  const ModelSpec& model() const override { return model_; }
  absl::StatusOr<ContentFingerprint> Fingerprint() const override;
  // The fingerprint the files record (the same in all); nullopt for older
  // checkpoints.
  const std::optional<ContentFingerprint>& recorded_fingerprint() const {
    return parts_[0]->recorded_fingerprint();
  }
  absl::Status Read(uint32_t layer, uint32_t tensor, ElementRange range,
                    std::span<float> dst) const override;
  // "DIR/shard-*-of-N.safetensors".
  const std::string& path() const override { return path_; }
  uint64_t version() const override { return parts_[0]->version(); }
  const std::optional<CheckpointTraining>& training() const override { return training_; }
  absl::Status ReadState(const std::string& name, std::vector<float>& values) const override;
  absl::Status VerifyChecksum() override;

  uint32_t from_count() const { return static_cast<uint32_t>(parts_.size()); }
  // The shards of the N whose slices overlap this shard's: the files it
  // reads, and the journals it replays.
  const std::vector<uint32_t>& overlapping() const { return overlapping_; }

 private:
  ReshardedCheckpoint() = default;
  absl::Status CheckAgreement();
  absl::Status MergeStaged();
  // Tensor `name`'s (layer, index).
  std::optional<std::pair<uint32_t, uint32_t>> FindTensor(const std::string& name) const;

  std::string path_;
  ModelSpec model_;
  uint32_t shard_index_ = 0;
  uint32_t num_shards_ = 1;
  std::vector<std::unique_ptr<CheckpointSource>> parts_;  // the N, by index
  std::vector<uint32_t> overlapping_;
  std::optional<CheckpointTraining> training_;
};

}  // namespace layercast::server
