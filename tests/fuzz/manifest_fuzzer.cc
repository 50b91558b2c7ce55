// Fuzzes the worker's checks of what a shard claims: CheckManifest on a
// layercast.v1.Manifest parsed from the input, and CheckShardSet on two
// copies of it. Properties: refusals are FAILED_PRECONDITION (or
// INVALID_ARGUMENT for the set's own arguments); an accepted manifest yields
// a view whose layouts agree with every field the manifest states; a set of
// two copies with the same shard index is always refused, and two copies
// numbered 0 and 1 of 2 are accepted exactly when each is on its own.

#include <cstdint>
#include <string>
#include <vector>

#include "client/manifest_check.h"
#include "tests/fuzz/fuzz_check.h"

namespace layercast::fuzz {
namespace {

bool IsRefusal(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition && !status.message().empty();
}

void CheckView(const layercast::v1::Manifest& manifest, const client::ShardSetView& view) {
  FUZZ_CHECK(view.num_shards == manifest.num_shards() && manifest.shard_index() < view.num_shards,
             "accepted shard %u of %u", manifest.shard_index(), manifest.num_shards());
  FUZZ_CHECK(view.model.layers.size() == static_cast<size_t>(manifest.layers_size()) &&
                 view.layouts.size() == view.model.layers.size(),
             "view has %zu layers and %zu layouts for %d manifest layers", view.model.layers.size(),
             view.layouts.size(), manifest.layers_size());
  FUZZ_CHECK(view.policy.ToString() == Policy::Parse(manifest.policy())->ToString(),
             "view policy differs from the manifest's");
  for (int l = 0; l < manifest.layers_size(); ++l) {
    const layercast::v1::Layer& layer = manifest.layers(l);
    const AssembledLayout& layout = view.layouts[l];
    FUZZ_CHECK(layout.total_bytes() == layer.assembled_bytes(), "layer %d size disagrees", l);
    FUZZ_CHECK(layout.tensors().size() == static_cast<size_t>(layer.tensors_size()),
               "layer %d tensor count disagrees", l);
    uint64_t end = 0;
    for (int t = 0; t < layer.tensors_size(); ++t) {
      const AssembledTensor& placed = layout.tensors()[t];
      const layercast::v1::Tensor& tensor = layer.tensors(t);
      FUZZ_CHECK(placed.byte_offset == tensor.byte_offset() &&
                     placed.num_elements == tensor.num_elements() &&
                     static_cast<int>(placed.compute_dtype) == tensor.compute_dtype(),
                 "layer %d tensor %d placed differently from the manifest", l, t);
      FUZZ_CHECK(placed.byte_offset % kAssembledAlignment == 0 && placed.byte_offset >= end,
                 "layer %d tensor %d at %llu overlaps or is unaligned", l, t,
                 static_cast<unsigned long long>(placed.byte_offset));
      end = placed.byte_offset + placed.num_bytes();
      FUZZ_CHECK(placed.compute_dtype == view.policy.ComputeDTypeFor(tensor.name()),
                 "tensor %s dtype differs from the policy", tensor.name().c_str());
    }
    FUZZ_CHECK(end <= layout.total_bytes(), "layer %d tensors end beyond its size", l);
  }
}

}  // namespace
}  // namespace layercast::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace layercast;
  layercast::v1::Manifest manifest;
  if (!manifest.ParseFromArray(data, static_cast<int>(size))) return 0;

  const absl::StatusOr<client::ShardSetView> view = client::CheckManifest(manifest);
  FUZZ_CHECK(view.ok() || fuzz::IsRefusal(view.status()), "CheckManifest gave %s",
             view.status().ToString().c_str());
  if (view.ok()) fuzz::CheckView(manifest, *view);

  const std::vector<std::string> addresses = {"a:1", "b:2"};
  const absl::StatusOr<client::ShardSetView> same =
      client::CheckShardSet({manifest, manifest}, addresses);
  FUZZ_CHECK(!same.ok(), "a set of one manifest twice (shard %u of %u) was accepted",
             manifest.shard_index(), manifest.num_shards());
  FUZZ_CHECK(fuzz::IsRefusal(same.status()), "CheckShardSet gave %s",
             same.status().ToString().c_str());

  layercast::v1::Manifest first = manifest, second = manifest;
  first.set_num_shards(2);
  first.set_shard_index(0);
  second.set_num_shards(2);
  second.set_shard_index(1);
  const absl::StatusOr<client::ShardSetView> alone = client::CheckManifest(first);
  const absl::StatusOr<client::ShardSetView> pair =
      client::CheckShardSet({first, second}, addresses);
  FUZZ_CHECK(pair.ok() == alone.ok(),
             "two copies numbered 0 and 1 of 2: the set says %s, one copy alone says %s",
             pair.status().ToString().c_str(), alone.status().ToString().c_str());
  if (pair.ok()) fuzz::CheckView(first, *pair);
  FUZZ_CHECK(client::CheckShardSet({}, {}).status().code() == absl::StatusCode::kInvalidArgument,
             "an empty set was not INVALID_ARGUMENT");
  return 0;
}
