#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/parameter_source.h"

namespace layercast::server {

// What a training shard saved beside its master (checkpoint_format.h).
struct CheckpointTraining {
  std::string optimizer;                  // the canonical spec
  std::vector<uint64_t> layer_versions;   // per layer
  std::vector<uint64_t> optimizer_steps;  // per layer
  // Pushes staged for open steps: (layer, worker index or kStagedMean).
  std::vector<std::pair<uint32_t, std::string>> staged;
  // The --data-parallel-workers it trained with; 0 when not recorded.
  uint64_t workers = 0;
  // The last clipped step and the scale it was applied with; nullopt when
  // none was (or not recorded).
  std::optional<std::pair<uint64_t, float>> last_clip;
};

// The checkpoint a shard starts from: its own file (CheckpointSource), or
// the files another shard count wrote, cut to this shard's element ranges
// (ReshardedCheckpoint). Either way the values, versions and optimizer
// state are this shard's: the rest of the shard cannot tell them apart.
class CheckpointState : public ParameterSource {
 public:
  // The file, or the files, for messages.
  virtual const std::string& path() const = 0;
  // The parameter version the checkpoint holds.
  virtual uint64_t version() const = 0;
  // Nullopt for a checkpoint of a read-only shard.
  virtual const std::optional<CheckpointTraining>& training() const = 0;
  // Optimizer state or staged push tensor `name` (OptimizerStateName,
  // StagedPushName): this shard's elements of it, whole, into `values`.
  // NOT_FOUND when the checkpoint has none of that name.
  virtual absl::Status ReadState(const std::string& name, std::vector<float>& values) const = 0;
  // DATA_LOSS naming the file unless what was read is what was written.
  // Call once, after loading, before anything is served.
  virtual absl::Status VerifyChecksum() = 0;
};

}  // namespace layercast::server
