#include "wire/owned_runs.h"

#include <gtest/gtest.h>

#include <vector>

namespace layercast::wire {
namespace {

// For every byte range on element boundaries of a small layout and every
// shard count, the shards' runs cover each selected element exactly once,
// in tensor order.
TEST(OwnedRunsTest, ShardsPartitionEveryRange) {
  const auto layout = AssembledLayout::FromDTypes(
      {DType::kBFloat16, DType::kFloat32, DType::kFloat16}, {7, 3, 130});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<AssembledTensor>& tensors = layout->tensors();
  std::vector<uint64_t> boundaries;  // every element boundary in the layout
  for (const AssembledTensor& t : tensors) {
    for (uint64_t e = 0; e <= t.num_elements; ++e) {
      boundaries.push_back(t.byte_offset + e * DTypeSize(t.compute_dtype));
    }
  }
  for (uint32_t n : {1u, 2u, 3u, 8u, 200u}) {
    for (size_t i = 0; i < boundaries.size(); i += 5) {
      for (size_t j = i + 1; j < boundaries.size(); j += 7) {
        const auto selected = layout->MapByteRange(boundaries[i], boundaries[j]);
        if (!selected.ok()) continue;  // empty: both ends in one padding gap
        std::vector<std::vector<int>> seen(tensors.size());
        for (size_t t = 0; t < tensors.size(); ++t) seen[t].assign(tensors[t].num_elements, 0);
        for (uint32_t shard = 0; shard < n; ++shard) {
          uint32_t last_tensor = 0;
          for (const TensorElementRange& run : OwnedRuns(*layout, *selected, shard, n)) {
            ASSERT_FALSE(run.elements.empty());
            ASSERT_GE(run.tensor, last_tensor);
            last_tensor = run.tensor;
            for (uint64_t e = run.elements.begin; e < run.elements.end; ++e) {
              ++seen[run.tensor][e];
            }
          }
        }
        for (const TensorElementRange& selection : *selected) {
          for (uint64_t e = 0; e < tensors[selection.tensor].num_elements; ++e) {
            const bool inside = e >= selection.elements.begin && e < selection.elements.end;
            ASSERT_EQ(seen[selection.tensor][e], inside ? 1 : 0)
                << "tensor " << selection.tensor << " element " << e << " of " << n << " shards";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace layercast::wire
