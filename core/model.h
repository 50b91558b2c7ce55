#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace layercast {

// One named tensor of a model, as the manifest lists it. Masters are always
// fp32; the compute dtype comes from the precision policy, not from here.
struct TensorSpec {
  std::string name;            // e.g. "model.layers.3.mlp.up_proj.weight"
  std::vector<int64_t> shape;  // row-major; empty for a scalar
  uint64_t num_elements = 0;   // product of `shape` (1 for a scalar)
};

// One layer: the unit a worker fetches. Tensors are in manifest order.
struct LayerSpec {
  std::string name;  // e.g. "model.layers.3", "model.embed_tokens", "final"
  std::vector<TensorSpec> tensors;
};

// The ordered layers of a model.
struct ModelSpec {
  std::string model_id;
  std::vector<LayerSpec> layers;
};

// Total fp32 elements of a model (all layers, all shards).
uint64_t TotalElements(const ModelSpec& model);

}  // namespace layercast
