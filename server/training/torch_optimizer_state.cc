#include "server/training/torch_optimizer_state.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/layout.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"

namespace layercast::server {
namespace {

constexpr char kFormat[] = "torch-optimizer-state";
constexpr char kStatePrefix[] = "state.";
// A float32 step count above this is no longer exact (torch's is one).
constexpr float kMaxExactStep = 16777216.0f;

// The buffers torch keeps for a parameter, as it names them.
std::vector<std::string> BufferNames(OptimizerKind kind, const OptimizerHyper& hyper) {
  if (kind == OptimizerKind::kAdamW) return {"exp_avg", "exp_avg_sq"};
  if (hyper.momentum > 0) return {"momentum_buffer"};
  return {};
}

// The first hyper-parameter (but lr) of `kind` on which `file` and `shard`
// differ, as "<key> <file's> here, <shard's> in --optimizer"; empty if none.
std::string HyperDifference(OptimizerKind kind, const OptimizerHyper& file,
                            const OptimizerHyper& shard) {
  const auto differ = [](const char* key, double a, double b) {
    return a == b ? std::string() : absl::StrCat(key, " ", a, " there, ", b, " in --optimizer");
  };
  std::vector<std::string> found;
  found.push_back(differ("weight_decay", file.weight_decay, shard.weight_decay));
  if (kind == OptimizerKind::kAdamW) {
    found.push_back(differ("beta1", file.beta1, shard.beta1));
    found.push_back(differ("beta2", file.beta2, shard.beta2));
    found.push_back(differ("eps", file.eps, shard.eps));
  } else {
    found.push_back(differ("momentum", file.momentum, shard.momentum));
    found.push_back(differ("nesterov", file.nesterov, shard.nesterov));
  }
  for (std::string& difference : found) {
    if (!difference.empty()) return difference;
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<TorchOptimizerState>> TorchOptimizerState::Open(
    const std::string& path, std::unique_ptr<ParameterSource> values, const OptimizerSpec& spec,
    uint32_t shard_index, uint32_t num_shards) {
  const auto refuse = [&path](auto&&... parts) {
    return absl::FailedPreconditionError(absl::StrCat("--optimizer-state ", path, ": ", parts...));
  };
  auto state = std::unique_ptr<TorchOptimizerState>(new TorchOptimizerState());
  state->path_ = path;
  state->values_ = std::move(values);
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  if (!reader.ok()) return refuse(reader.status().message());
  state->reader_ = *std::move(reader);
  const SafetensorsReader& file = *state->reader_;
  const auto& metadata = file.metadata();
  const auto format = metadata.find("format");
  const auto optimizer = metadata.find("optimizer");
  if (format == metadata.end() || format->second != kFormat || optimizer == metadata.end()) {
    return refuse("not an optimizer state (its __metadata__ lacks format \"", kFormat,
                  "\" or optimizer): write it with layercast.torch.save_optimizer_state or "
                  "export_checkpoint");
  }
  absl::StatusOr<OptimizerSpec> saved = OptimizerSpec::Parse(optimizer->second);
  if (!saved.ok()) return refuse("its optimizer: ", saved.status().message());
  if (saved->kind() != spec.kind()) {
    return refuse("it holds ", OptimizerKindName(saved->kind()), " state, but --optimizer is ",
                  OptimizerKindName(spec.kind()), ": start with --optimizer ",
                  OptimizerKindName(saved->kind()), ":... or from zero state");
  }

  const ModelSpec& model = state->values_->model();
  std::set<std::string> expected;  // every tensor name the file may hold
  CheckpointTraining training;
  training.optimizer = spec.ToString();
  for (const LayerSpec& layer : model.layers) {
    std::optional<uint64_t> layer_steps;
    std::string first;  // the tensor that set layer_steps, for messages
    for (const TensorSpec& tensor : layer.tensors) {
      const OptimizerHyper hyper = spec.HyperFor(tensor.name);
      if (const std::string difference =
              HyperDifference(spec.kind(), saved->HyperFor(tensor.name), hyper);
          !difference.empty()) {
        return refuse("parameter ", tensor.name, " has ", difference,
                      ": start with the state's hyper-parameters (only lr and the schedule may "
                      "change)");
      }
      const ElementRange owned = ShardElementRange(tensor.num_elements, shard_index, num_shards);
      bool has_buffers = false;
      for (const std::string& buffer : BufferNames(spec.kind(), hyper)) {
        const std::string name = absl::StrCat(kStatePrefix, tensor.name, ".", buffer);
        expected.insert(name);
        const SafetensorsTensor* found = file.Find(name);
        if (found == nullptr) {
          return refuse("no ", name,
                        ": every parameter the model has needs its state (zeros and "
                        "step 0 for one not trained yet)");
        }
        if (found->shape != tensor.shape || found->dtype != DType::kFloat32) {
          return refuse(name, " is ", DTypeName(found->dtype), " [",
                        absl::StrJoin(found->shape, ", "), "], but the parameter is float32 [",
                        absl::StrJoin(tensor.shape, ", "),
                        "]: the state is for another model, or the wrong file");
        }
        state->buffers_[OptimizerStateName(buffer, tensor.name)] = Buffer{found, owned};
        has_buffers = true;
      }
      const std::string step_name = absl::StrCat(kStatePrefix, tensor.name, ".step");
      expected.insert(step_name);
      uint64_t steps = 0;
      if (const SafetensorsTensor* step = file.Find(step_name); step != nullptr) {
        float value = 0;
        if (step->num_elements != 1) {
          return refuse(step_name, " holds ", step->num_elements, " values, not one");
        }
        RETURN_IF_ERROR(file.ReadF32(*step, ElementRange{0, 1}, std::span<float>(&value, 1)));
        if (!(value >= 0 && value <= kMaxExactStep) || std::floor(value) != value) {
          return refuse(step_name, " is ", value, ", not a step count");
        }
        steps = static_cast<uint64_t>(value);
      } else if (spec.kind() == OptimizerKind::kAdamW) {
        return refuse("no ", step_name, ": AdamW's bias correction needs every parameter's step");
      } else {
        steps = has_buffers ? 1 : 0;  // torch's SGD counts no steps: a buffer means one was taken
      }
      if (!layer_steps) {
        layer_steps = steps;
        first = tensor.name;
      } else if (*layer_steps != steps) {
        return refuse(first, " is at step ", *layer_steps, " and ", tensor.name, " at step ", steps,
                      ", in one layer (", layer.name,
                      "), whose tensors layercast steps together: train them together in torch "
                      "first");
      }
    }
    training.layer_versions.push_back(layer_steps.value_or(0));
    training.optimizer_steps.push_back(layer_steps.value_or(0));
  }
  for (const SafetensorsTensor& tensor : file.tensors()) {
    if (!expected.contains(tensor.name)) {
      return refuse("it holds ", tensor.name, ", which names no state of a parameter of model ",
                    model.model_id, " under --optimizer ", spec.ToString(),
                    ": the state is for another model, or the wrong file");
    }
  }
  state->version_ =
      training.layer_versions.empty()
          ? 0
          : *std::min_element(training.layer_versions.begin(), training.layer_versions.end());
  state->training_ = std::move(training);
  return state;
}

absl::Status TorchOptimizerState::ReadState(const std::string& name,
                                            std::vector<float>& values) const {
  const auto found = buffers_.find(name);
  if (found == buffers_.end()) {
    return absl::NotFoundError(absl::StrCat("--optimizer-state ", path_, " holds no ", name));
  }
  const Buffer& buffer = found->second;
  values.resize(buffer.owned.size());
  return reader_->ReadF32(*buffer.tensor, buffer.owned, values);
}

}  // namespace layercast::server
