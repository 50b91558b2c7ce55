#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/parameter_source.h"
#include "core/policy.h"
#include "core/safetensors.h"
#include "platform/file_system.h"
#include "server/checkpoints/checkpoint_format.h"
#include "server/checkpoints/checkpoint_state.h"

namespace layercast::server {

// A shard's parameters from its own checkpoint file (format:
// server/checkpoints/checkpoint_format.h), for ParameterStore::Load. The model's layout
// comes from elsewhere (--model or --synthetic); the checkpoint must match it.
//
// Open() checks the header against what this shard serves: format, model id,
// shard count and index, layout digest (model and policy), and every tensor's
// name, dtype and element count. The data's checksum needs every byte, so it
// is checked by VerifyChecksum() once loading has read them; nothing may be
// served before it passes.
//
// Thread-safe: Read may run concurrently.
class CheckpointSource final : public CheckpointState {
 public:
  // FAILED_PRECONDITION naming `path` and the first mismatch; DATA_LOSS when
  // the file is not a valid checkpoint. `fs` must outlive the source.
  static absl::StatusOr<std::unique_ptr<CheckpointSource>> Open(
      const std::string& path, const ModelSpec& model, uint32_t shard_index, uint32_t num_shards,
      const Policy& policy, std::optional<ContentFingerprint> lineage = std::nullopt,
      FileSystem& fs = DefaultFileSystem());

  const ModelSpec& model() const override { return model_; }
  // The fingerprint of the model the checkpoint descends from: the one it
  // records, else (a checkpoint written before fingerprints) the `lineage`
  // given to Open; FAILED_PRECONDITION with neither.
  absl::StatusOr<ContentFingerprint> Fingerprint() const override;
  // The fingerprint the file records; nullopt for older checkpoints.
  const std::optional<ContentFingerprint>& recorded_fingerprint() const {
    return recorded_fingerprint_;
  }
  // Only the elements this shard owns are in the file: OUT_OF_RANGE for
  // others.
  absl::Status Read(uint32_t layer, uint32_t tensor, ElementRange range,
                    std::span<float> dst) const override;

  const std::string& path() const override { return path_; }
  uint64_t version() const override { return version_; }
  // "sha256:<hex>" as the header records it.
  const std::string& checksum() const { return checksum_; }

  using Training = CheckpointTraining;
  const std::optional<Training>& training() const override { return training_; }
  // Reads optimizer state or staged push tensor `name` (OptimizerStateName,
  // StagedPushName) whole into `values`. NOT_FOUND when the file has none of
  // that name.
  absl::Status ReadState(const std::string& name, std::vector<float>& values) const override;
  // Elements `range` of that tensor into `dst` (dst.size() == range.size()):
  // what a resharded load reads, only the bytes it owns. OUT_OF_RANGE past
  // the tensor's end.
  absl::Status ReadStateRange(const std::string& name, ElementRange range,
                              std::span<float> dst) const;

  // DATA_LOSS naming the file unless the SHA-256 of its data equals the
  // recorded checksum. Hashes what Read() returned when that was every
  // tensor, whole, in file order (as ParameterStore::Load reads); otherwise
  // reads the data again. Call once, after loading.
  absl::Status VerifyChecksum() override;
  // As VerifyChecksum, for a file read in ranges (a resharded load): with
  // block checksums (block_crc32c), checks each block a read touched,
  // reading those blocks and no others; without, VerifyChecksum. DATA_LOSS
  // naming the file and the first block that fails. Call once, after
  // loading.
  absl::Status VerifyReadBlocks();

 private:
  CheckpointSource() = default;
  absl::Status CheckHeader(const Policy& policy);
  absl::Status ParseTraining();
  // Feeds what a read returned to the running hash when it is the next
  // whole tensor in file order.
  void Hash(const SafetensorsTensor& entry, bool whole, std::span<const float> values) const;
  // Notes the blocks elements `range` of `entry` lie in.
  void Touch(const SafetensorsTensor& entry, ElementRange range) const;

  std::string path_;
  ModelSpec model_;
  uint32_t shard_index_ = 0;
  uint32_t num_shards_ = 1;
  uint64_t version_ = 0;
  std::optional<ContentFingerprint> recorded_fingerprint_;
  std::optional<ContentFingerprint> lineage_;
  std::string checksum_;
  std::unique_ptr<SafetensorsReader> reader_;
  // Per layer, per tensor: its entry in the file.
  std::vector<std::vector<const SafetensorsTensor*>> entries_;
  // Every entry, by position in the file.
  std::vector<const SafetensorsTensor*> file_order_;
  std::optional<Training> training_;
  std::optional<BlockChecksums> blocks_;
  // Where the data section starts in the file.
  uint64_t data_begin_ = 0;

  // The running hash of whole tensors read in file order.
  mutable absl::Mutex mu_;
  mutable std::unique_ptr<Sha256> sha_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t next_offset_ ABSL_GUARDED_BY(mu_) = 0;
  mutable size_t hashed_tensors_ ABSL_GUARDED_BY(mu_) = 0;
  mutable bool out_of_order_ ABSL_GUARDED_BY(mu_) = false;
  // The blocks of the data section reads touched (with blocks_).
  mutable std::vector<bool> touched_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::server
