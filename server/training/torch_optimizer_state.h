#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/optimizer_spec.h"
#include "core/safetensors.h"
#include "server/checkpoints/checkpoint_state.h"

namespace layercast::server {

// torch.optim's state_dict() by parameter name, as a safetensors file (or
// index) that layercast.torch writes (save_optimizer_state,
// export_checkpoint) and --optimizer-state names:
//
//   state.<name>.exp_avg, state.<name>.exp_avg_sq  F32, the parameter's shape (AdamW)
//   state.<name>.momentum_buffer                   F32, the parameter's shape (SGD)
//   state.<name>.step                              F32, shape [] (torch's
//                                                  state['step']; AdamW)
//
// and this `__metadata__`:
//
//   format        "torch-optimizer-state"
//   optimizer     the param groups' hyper-parameters as an optimizer spec
//                 (core/optimizer_spec.h): the first group's as its first
//                 part, every parameter of another group as an override
//                 of its own name
//   param_groups  torch's param_groups as JSON, parameters by name (read
//                 by layercast.torch; not here)
//
// A shard starting from it trains on as torch.optim would have, bit for
// bit: every layer at the version its step count says (so a schedule goes
// on where it was), each of its tensors' buffers this shard's elements.
// Thread-safe after Open.
class TorchOptimizerState final : public CheckpointState {
 public:
  // Checks the whole file against `model` and `spec` (the shard's
  // --optimizer) before anything is read: FAILED_PRECONDITION naming the
  // file and the first mismatch (another optimizer kind, betas, eps,
  // momentum, nesterov or weight_decay than `spec` gives a parameter; a
  // parameter without its state, or with state of another shape; a name
  // the model lacks; tensors of one layer at different steps). The lr is
  // not compared: the schedule is the shard's. `values` gives the master
  // (the --model the state goes with).
  static absl::StatusOr<std::unique_ptr<TorchOptimizerState>> Open(
      const std::string& path, std::unique_ptr<ParameterSource> values, const OptimizerSpec& spec,
      uint32_t shard_index, uint32_t num_shards);

  const ModelSpec& model() const override { return values_->model(); }
  absl::Status Read(uint32_t layer, uint32_t tensor, ElementRange range,
                    std::span<float> dst) const override {
    return values_->Read(layer, tensor, range, dst);
  }
  absl::StatusOr<ContentFingerprint> Fingerprint() const override { return values_->Fingerprint(); }

  const std::string& path() const override { return path_; }
  uint64_t version() const override { return version_; }
  const std::optional<CheckpointTraining>& training() const override { return training_; }
  // `name` as OptimizerStateName gives it: this shard's elements of the
  // buffer. NOT_FOUND for any other name (no staged pushes).
  absl::Status ReadState(const std::string& name, std::vector<float>& values) const override;
  // The safetensors header was checked on Open; there is no checksum.
  absl::Status VerifyChecksum() override { return absl::OkStatus(); }

 private:
  TorchOptimizerState() = default;

  struct Buffer {
    const SafetensorsTensor* tensor = nullptr;
    ElementRange owned;
  };

  std::string path_;
  std::unique_ptr<ParameterSource> values_;
  std::unique_ptr<SafetensorsReader> reader_;
  uint64_t version_ = 0;
  std::optional<CheckpointTraining> training_;
  std::map<std::string, Buffer> buffers_;  // by OptimizerStateName
};

}  // namespace layercast::server
