#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/safetensors.h"

namespace layercast {

// Groups a checkpoint's named tensors into the ordered layers of a ModelSpec.
// Pure functions of their arguments; thread-safe.

// How tensor names map to layers. The defaults follow the Hugging Face
// convention: embeddings first, then `model.layers.<i>.` by ascending i, then
// everything else in one last layer.
struct LayerGroupingRule {
  // Tensors whose name starts with this form the first layer, named after the
  // prefix without its trailing '.'. Empty: no first layer.
  std::string first_prefix = "model.embed_tokens.";
  // ECMAScript regex searched in each name; exactly one capture group, the
  // decimal layer index (a match in which an optional group took no part
  // names no layer: the tensor goes to the last layer). The layer is named after the whole match
  // without its trailing '.' (e.g. "model.layers.3").
  std::string layer_regex = R"(^model\.layers\.(\d+)\.)";
  // Name of the layer holding every other tensor.
  std::string last_name = "final";
};

// Layers in order: the first-prefix layer, the regex layers by ascending
// integer index, then `rule.last_name`; empty groups are omitted. Within a
// layer, tensors are sorted by name. INVALID_ARGUMENT when `tensors` is empty,
// a name is empty or repeated, a shape is negative or disagrees with
// num_elements, `layer_regex` does not compile or has other than one capture
// group, a capture is not a decimal index, one index is spelled two ways
// ("layers.3." and "layers.03."), or two layers end up with the same name.
absl::StatusOr<ModelSpec> GroupIntoLayers(std::string model_id, std::vector<TensorSpec> tensors,
                                          const LayerGroupingRule& rule = {});

// GroupIntoLayers over every tensor of `reader`.
absl::StatusOr<ModelSpec> ModelSpecFromSafetensors(const SafetensorsReader& reader,
                                                   std::string model_id,
                                                   const LayerGroupingRule& rule = {});

}  // namespace layercast
