#include "core/model.h"

namespace layercast {

uint64_t TotalElements(const ModelSpec& model) {
  uint64_t total = 0;
  for (const LayerSpec& layer : model.layers) {
    for (const TensorSpec& tensor : layer.tensors) total += tensor.num_elements;
  }
  return total;
}

}  // namespace layercast
