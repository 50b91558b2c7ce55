#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tests/integration/test_model.h"

namespace layercast::testing {

// The values of WriteTestModel(path, num_layers, seed) with every third
// value scaled by 1 + nudge: what the fault tests publish, computed the same
// way in the test and in the publisher it kills. Writes `path`.
inline std::map<std::string, std::vector<float>> NudgedModel(const std::string& path,
                                                             int num_layers, uint64_t seed,
                                                             float nudge) {
  std::map<std::string, std::vector<float>> values = WriteTestModel(path, num_layers, seed).values;
  for (auto& [name, tensor] : values) {
    for (size_t i = 0; i < tensor.size(); i += 3) tensor[i] *= 1 + nudge;
  }
  return values;
}

}  // namespace layercast::testing
