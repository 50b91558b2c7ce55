#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace layercast::testing {

// A small Hugging Face-style checkpoint written to a real safetensors file:
// embeddings, `num_layers` decoder layers and a final norm and head, with
// awkward (prime) sizes so shards split unevenly, values that exercise
// rounding (ties, subnormals, large magnitudes), and a few tensors stored as
// BF16 and F16 so loading widens them.
struct TestModel {
  std::string path;
  // Every tensor's values as the fp32 master will hold them, by name.
  std::map<std::string, std::vector<float>> values;
};

TestModel WriteTestModel(const std::string& path, int num_layers, uint64_t seed);

}  // namespace layercast::testing
