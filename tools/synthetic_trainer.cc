#include "tools/synthetic_trainer.h"

#include <memory>

#include "core/optimizer_spec.h"
#include "core/synthetic_model.h"
#include "platform/status_macros.h"

namespace layercast::tools {

absl::StatusOr<SyntheticTrainer> SyntheticTrainer::Create(const std::string& spec) {
  ASSIGN_OR_RETURN(std::unique_ptr<SyntheticModel> model, SyntheticModel::Create(spec));
  // The lr here is a placeholder: each Step names its own.
  ASSIGN_OR_RETURN(const OptimizerSpec optimizer, OptimizerSpec::Parse("adamw:lr=1e-4"));
  SyntheticTrainer trainer;
  for (uint32_t l = 0; l < model->model().layers.size(); ++l) {
    const LayerSpec& layer = model->model().layers[l];
    for (uint32_t t = 0; t < layer.tensors.size(); ++t) {
      const TensorSpec& tensor = layer.tensors[t];
      std::vector<float>& values = trainer.values_[tensor.name];
      values.resize(tensor.num_elements);
      RETURN_IF_ERROR(model->Read(l, t, {0, tensor.num_elements}, values));
      trainer.optimizers_.emplace(
          tensor.name, TensorOptimizer(OptimizerKind::kAdamW, optimizer.HyperFor(tensor.name),
                                       tensor.num_elements));
      trainer.elements_ += tensor.num_elements;
    }
  }
  return trainer;
}

absl::Status SyntheticTrainer::Step(double lr) {
  std::normal_distribution<float> gradient(0.0f, 1e-3f);
  for (auto& [name, values] : values_) {
    gradient_.resize(values.size());
    for (float& g : gradient_) g = gradient(random_);
    RETURN_IF_ERROR(optimizers_.at(name).Step(lr, values, gradient_));
  }
  return absl::OkStatus();
}

}  // namespace layercast::tools
