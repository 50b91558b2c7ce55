#include "wire/owned_runs.h"

namespace layercast::wire {

std::vector<TensorElementRange> OwnedRuns(const AssembledLayout& layout,
                                          const std::vector<TensorElementRange>& selected,
                                          uint32_t shard, uint32_t num_shards) {
  std::vector<TensorElementRange> runs;
  for (const TensorElementRange& selection : selected) {
    const uint64_t elements = layout.tensors()[selection.tensor].num_elements;
    const ElementRange owned =
        Intersect(selection.elements, ShardElementRange(elements, shard, num_shards));
    if (!owned.empty()) runs.push_back(TensorElementRange{selection.tensor, owned});
  }
  return runs;
}

std::vector<TensorElementRange> OwnedLayerRuns(const AssembledLayout& layout, uint32_t shard,
                                               uint32_t num_shards) {
  std::vector<TensorElementRange> whole;
  for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
    whole.push_back(TensorElementRange{t, ElementRange{0, layout.tensors()[t].num_elements}});
  }
  return OwnedRuns(layout, whole, shard, num_shards);
}

}  // namespace layercast::wire
