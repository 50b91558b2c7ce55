// Fuzzes the worker's checks of what a shard claims: CheckManifest on a
// layercast.v1.Manifest parsed from the input, and CheckShardSet on two
// copies of it. Every input is checked twice: as it is, and repaired the way
// a forger would, with element counts, compute dtypes, offsets, sizes and the
// layout digest recomputed to agree (offsets and sizes with unchecked uint64
// arithmetic), so mutations reach the checks past the digest rather than
// stopping at it. Properties: refusals are FAILED_PRECONDITION (or
// INVALID_ARGUMENT for the set's own arguments); an accepted manifest yields
// a view whose layouts agree with every field the manifest states, lie within
// the caps, and place every tensor inside its layer; a set of two copies with
// the same shard index is always refused, and two copies numbered 0 and 1 of
// 2 are accepted exactly when each is on its own.

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "tests/fuzz/fuzz_check.h"
#include "wire/manifest.h"

namespace layercast::fuzz {
namespace {

bool IsRefusal(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition && !status.message().empty();
}

void CheckView(const layercast::v1::Manifest& manifest, const wire::ShardSetView& view) {
  FUZZ_CHECK(view.num_shards == manifest.num_shards() && manifest.shard_index() < view.num_shards,
             "accepted shard %u of %u", manifest.shard_index(), manifest.num_shards());
  FUZZ_CHECK(view.layouts.size() <= wire::kMaxManifestLayers, "accepted %zu layers",
             view.layouts.size());
  size_t num_tensors = 0;
  for (const AssembledLayout& layout : view.layouts) num_tensors += layout.tensors().size();
  FUZZ_CHECK(num_tensors <= wire::kMaxManifestTensors, "accepted %zu tensors", num_tensors);
  FUZZ_CHECK(view.model.layers.size() == static_cast<size_t>(manifest.layers_size()) &&
                 view.layouts.size() == view.model.layers.size(),
             "view has %zu layers and %zu layouts for %d manifest layers", view.model.layers.size(),
             view.layouts.size(), manifest.layers_size());
  FUZZ_CHECK(view.gradient_layouts.size() == view.layouts.size(),
             "view has %zu gradient layouts for %zu layouts", view.gradient_layouts.size(),
             view.layouts.size());
  for (size_t l = 0; l < view.layouts.size(); ++l) {
    const auto& served = view.layouts[l].tensors();
    const auto& gradient = view.gradient_layouts[l].tensors();
    FUZZ_CHECK(gradient.size() == served.size(), "layer %zu's gradient layout has %zu tensors", l,
               gradient.size());
    for (size_t t = 0; t < served.size(); ++t) {
      FUZZ_CHECK(
          gradient[t].num_elements == served[t].num_elements && gradient[t].block_size == 0 &&
              gradient[t].compute_dtype ==
                  (IsFloat8(served[t].compute_dtype) ? DType::kFloat32 : served[t].compute_dtype),
          "layer %zu tensor %zu's gradient is laid out unlike its served tensor", l, t);
    }
  }
  FUZZ_CHECK(view.policy.ToString() == Policy::Parse(manifest.policy())->ToString(),
             "view policy differs from the manifest's");
  for (int l = 0; l < manifest.layers_size(); ++l) {
    const layercast::v1::Layer& layer = manifest.layers(l);
    // A relay's manifest (held_dtype) lists its tensors as it holds them:
    // the view's layout pulled in that dtype.
    std::optional<AssembledLayout> held;
    if (manifest.has_held_dtype()) {
      absl::StatusOr<AssembledLayout> in_held = LayoutIn(
          view.layouts[l], static_cast<DType>(manifest.held_dtype()), view.policy.fp8_block());
      FUZZ_CHECK(in_held.ok(), "layer %d accepted without a layout in its held_dtype", l);
      held = *std::move(in_held);
    }
    const AssembledLayout& layout = held ? *held : view.layouts[l];
    FUZZ_CHECK(layout.total_bytes() == layer.assembled_bytes(), "layer %d size disagrees", l);
    FUZZ_CHECK(layout.total_bytes() <= kMaxAssembledLayerBytes, "layer %d of %llu bytes accepted",
               l, static_cast<unsigned long long>(layout.total_bytes()));
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
      // Checked here, not trusted to num_bytes(): a layout that wrapped is
      // exactly what this looks for.
      uint64_t bytes = 0;
      FUZZ_CHECK(
          !__builtin_mul_overflow(placed.num_elements, DTypeSize(placed.compute_dtype), &bytes) &&
              !__builtin_add_overflow(placed.byte_offset, bytes, &end),
          "layer %d tensor %d ends past 2^64", l, t);
      FUZZ_CHECK(
          view.layouts[l].tensors()[t].compute_dtype == view.policy.ComputeDTypeFor(tensor.name()),
          "tensor %s dtype differs from the policy", tensor.name().c_str());
    }
    FUZZ_CHECK(end <= layout.total_bytes(), "layer %d tensors end beyond its size", l);
  }
}

// `manifest` with every figure CheckManifest recomputes made to agree, as a
// forger sending it would: layer indices, element counts (where the shape has
// a product), compute dtypes (where the policy parses), offsets and assembled
// sizes laid out with unchecked uint64 arithmetic, and the layout digest
// where the library can compute one (where it cannot, CheckManifest refuses
// the layout before it looks at the digest).
layercast::v1::Manifest Repaired(layercast::v1::Manifest manifest) {
  const absl::StatusOr<Policy> policy = Policy::Parse(manifest.policy());
  ModelSpec model;
  for (int l = 0; l < manifest.layers_size(); ++l) {
    layercast::v1::Layer& layer = *manifest.mutable_layers(l);
    layer.set_index(static_cast<uint32_t>(l));
    LayerSpec spec{layer.name(), {}};
    uint64_t offset = 0;
    for (layercast::v1::Tensor& tensor : *layer.mutable_tensors()) {
      uint64_t n = 1;
      bool has_product = true;
      for (int64_t dim : tensor.shape()) {
        has_product =
            has_product && dim >= 0 && !__builtin_mul_overflow(n, static_cast<uint64_t>(dim), &n);
      }
      if (has_product) tensor.set_num_elements(n);
      if (policy.ok()) {
        tensor.set_compute_dtype(
            static_cast<layercast::v1::DType>(policy->ComputeDTypeFor(tensor.name())));
      }
      const uint64_t element_size =
          layercast::v1::DType_IsValid(tensor.compute_dtype()) &&
                  tensor.compute_dtype() != layercast::v1::DTYPE_UNSPECIFIED
              ? DTypeSize(static_cast<DType>(tensor.compute_dtype()))
              : 4;
      tensor.set_byte_offset(offset);
      offset = (offset + tensor.num_elements() * element_size + kAssembledAlignment - 1) /
               kAssembledAlignment * kAssembledAlignment;
      spec.tensors.push_back(TensorSpec{
          tensor.name(), {tensor.shape().begin(), tensor.shape().end()}, tensor.num_elements()});
    }
    layer.set_assembled_bytes(offset);
    model.layers.push_back(std::move(spec));
  }
  if (policy.ok()) {
    const absl::StatusOr<std::array<uint8_t, 32>> digest = LayoutDigest(model, *policy);
    if (digest.ok()) manifest.set_layout_digest(std::string(digest->begin(), digest->end()));
  }
  return manifest;
}

void CheckAll(const layercast::v1::Manifest& manifest) {
  const absl::StatusOr<wire::ShardSetView> view = wire::CheckManifest(manifest);
  FUZZ_CHECK(view.ok() || IsRefusal(view.status()), "CheckManifest gave %s",
             view.status().ToString().c_str());
  if (view.ok()) CheckView(manifest, *view);

  const std::vector<std::string> addresses = {"a:1", "b:2"};
  const absl::StatusOr<wire::ShardSetView> same =
      wire::CheckShardSet({manifest, manifest}, addresses);
  FUZZ_CHECK(!same.ok(), "a set of one manifest twice (shard %u of %u) was accepted",
             manifest.shard_index(), manifest.num_shards());
  FUZZ_CHECK(IsRefusal(same.status()), "CheckShardSet gave %s", same.status().ToString().c_str());

  layercast::v1::Manifest first = manifest, second = manifest;
  first.set_num_shards(2);
  first.set_shard_index(0);
  second.set_num_shards(2);
  second.set_shard_index(1);
  const absl::StatusOr<wire::ShardSetView> alone = wire::CheckManifest(first);
  const absl::StatusOr<wire::ShardSetView> pair = wire::CheckShardSet({first, second}, addresses);
  FUZZ_CHECK(pair.ok() == alone.ok(),
             "two copies numbered 0 and 1 of 2: the set says %s, one copy alone says %s",
             pair.status().ToString().c_str(), alone.status().ToString().c_str());
  if (pair.ok()) CheckView(first, *pair);
  FUZZ_CHECK(wire::CheckShardSet({}, {}).status().code() == absl::StatusCode::kInvalidArgument,
             "an empty set was not INVALID_ARGUMENT");
}

}  // namespace
}  // namespace layercast::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  layercast::v1::Manifest manifest;
  if (!manifest.ParseFromArray(data, static_cast<int>(size))) return 0;
  layercast::fuzz::CheckAll(manifest);
  layercast::fuzz::CheckAll(layercast::fuzz::Repaired(manifest));
  return 0;
}
