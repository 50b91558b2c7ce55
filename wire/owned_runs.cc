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

}  // namespace layercast::wire
