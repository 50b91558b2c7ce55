#pragma once

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/optimizer.h"

namespace layercast::tools {

// A trainer that keeps its own fp32 model and optimizer, as one publishing
// to read-only shards does (`layercast demo --publish`, bench/delta_bench): a synthetic
// model's values, a torch-exact AdamW per tensor (core/optimizer.h, torch's
// defaults), stepped on Gaussian gradients (sigma 1e-3, a realistic size for
// a large model's per-element gradients) from a fixed seed.
//
// Not thread-safe.
class SyntheticTrainer {
 public:
  // `spec` as SyntheticModel::Create takes it.
  static absl::StatusOr<SyntheticTrainer> Create(const std::string& spec);

  // One AdamW step of every tensor at learning rate `lr`.
  absl::Status Step(double lr);

  // Every tensor's fp32 values now, by name.
  const std::map<std::string, std::vector<float>>& values() const { return values_; }
  uint64_t elements() const { return elements_; }

 private:
  SyntheticTrainer() = default;
  std::map<std::string, std::vector<float>> values_;
  std::map<std::string, TensorOptimizer> optimizers_;
  std::mt19937_64 random_{42};
  std::vector<float> gradient_;  // scratch, reused by each tensor
  uint64_t elements_ = 0;
};

}  // namespace layercast::tools
