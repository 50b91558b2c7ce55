#pragma once

#include <cstdint>
#include <vector>

#include "core/layout.h"

namespace layercast::wire {

// The elements of `selected` (a byte range of `layout`, mapped by
// AssembledLayout::MapByteRange) that shard `shard` of `num_shards` owns,
// tensor by tensor in order, runs it owns nothing of left out. What a shard
// streams for a FetchLayer request and what the worker expects from it are
// both this, so the two sides cannot disagree on it.
// REQUIRES: shard < num_shards; `selected` names tensors of `layout`.
std::vector<TensorElementRange> OwnedRuns(const AssembledLayout& layout,
                                          const std::vector<TensorElementRange>& selected,
                                          uint32_t shard, uint32_t num_shards);

// OwnedRuns of the whole layer: every element shard `shard` owns, which is
// what a PushGradients stream to it carries.
std::vector<TensorElementRange> OwnedLayerRuns(const AssembledLayout& layout, uint32_t shard,
                                               uint32_t num_shards);

}  // namespace layercast::wire
