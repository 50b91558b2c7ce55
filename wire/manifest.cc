#include "wire/manifest.h"

#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "platform/status_macros.h"

namespace layercast::wire {
namespace {

absl::Status Bad(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat("inconsistent manifest: ", what));
}

}  // namespace

layercast::v1::Manifest BuildManifest(const ManifestFacts& facts) {
  layercast::v1::Manifest manifest;
  const ModelSpec& model = *facts.model;
  manifest.set_model_id(model.model_id);
  manifest.set_num_shards(facts.num_shards);
  manifest.set_shard_index(facts.shard_index);
  manifest.set_policy(facts.policy->ToString());
  manifest.set_layout_digest(std::string(facts.layout_digest.begin(), facts.layout_digest.end()));
  manifest.set_content_fingerprint(
      std::string(facts.content_fingerprint.begin(), facts.content_fingerprint.end()));
  manifest.set_incarnation(facts.incarnation);
  manifest.set_data_parallel_workers(facts.data_parallel_workers);
  manifest.set_optimizer(facts.optimizer);
  manifest.set_chunk_bytes(facts.chunk_bytes);
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    const LayerSpec& spec = model.layers[l];
    const AssembledLayout& layout = facts.layouts[l];
    layercast::v1::Layer* layer = manifest.add_layers();
    layer->set_index(l);
    layer->set_name(spec.name);
    layer->set_assembled_bytes(layout.total_bytes());
    for (uint32_t t = 0; t < spec.tensors.size(); ++t) {
      layercast::v1::Tensor* tensor = layer->add_tensors();
      tensor->set_name(spec.tensors[t].name);
      for (int64_t dim : spec.tensors[t].shape) tensor->add_shape(dim);
      tensor->set_param_dtype(layercast::v1::FLOAT32);
      tensor->set_compute_dtype(
          static_cast<layercast::v1::DType>(layout.tensors()[t].compute_dtype));
      tensor->set_byte_offset(layout.tensors()[t].byte_offset);
      tensor->set_num_elements(spec.tensors[t].num_elements);
      tensor->set_block_size(layout.tensors()[t].block_size);
      tensor->set_scale_offset(layout.tensors()[t].scale_offset);
    }
  }
  return manifest;
}

absl::StatusOr<ShardSetView> CheckManifest(const layercast::v1::Manifest& manifest) {
  ShardSetView view;
  if (manifest.num_shards() == 0 || manifest.shard_index() >= manifest.num_shards()) {
    return Bad(absl::StrCat("shard_index ", manifest.shard_index(), " of num_shards ",
                            manifest.num_shards()));
  }
  view.num_shards = manifest.num_shards();
  // Counted before anything is built from them (the message size bounds the
  // sum well below 2^64).
  uint64_t num_tensors = 0;
  for (const layercast::v1::Layer& layer : manifest.layers()) num_tensors += layer.tensors_size();
  if (static_cast<uint64_t>(manifest.layers_size()) > kMaxManifestLayers) {
    return Bad(absl::StrCat("it lists ", manifest.layers_size(), " layers, more than a worker ",
                            "accepts (", kMaxManifestLayers, ")"));
  }
  if (num_tensors > kMaxManifestTensors) {
    return Bad(absl::StrCat("it lists ", num_tensors, " tensors, more than a worker accepts (",
                            kMaxManifestTensors, ")"));
  }
  absl::StatusOr<Policy> policy = Policy::Parse(manifest.policy());
  if (!policy.ok()) return Bad(policy.status().message());
  view.policy = *policy;
  view.model.model_id = manifest.model_id();
  // A relay's tensors are listed in the dtype it holds them in, laid out as
  // a pull in that dtype; the view stays the policy's, as the digest is.
  std::optional<DType> held;
  if (manifest.has_held_dtype()) {
    if (manifest.held_dtype() == layercast::v1::DTYPE_UNSPECIFIED ||
        !layercast::v1::DType_IsValid(manifest.held_dtype())) {
      return Bad(absl::StrCat("held_dtype ", manifest.held_dtype(), " is no dtype"));
    }
    held = static_cast<DType>(manifest.held_dtype());
  }
  for (int l = 0; l < manifest.layers_size(); ++l) {
    const layercast::v1::Layer& layer = manifest.layers(l);
    if (layer.index() != static_cast<uint32_t>(l)) {
      return Bad(absl::StrCat("layer at position ", l, " says index ", layer.index()));
    }
    LayerSpec spec{layer.name(), {}};
    std::vector<DType> dtypes;
    std::vector<uint64_t> counts;
    for (const layercast::v1::Tensor& tensor : layer.tensors()) {
      uint64_t n = 1;
      for (int64_t dim : tensor.shape()) {
        if (dim < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(dim), &n)) {
          return Bad(absl::StrCat("tensor ", tensor.name(), " has an impossible shape"));
        }
      }
      // The size is capped with the layer's, by the layout below.
      if (n != tensor.num_elements()) {
        return Bad(absl::StrCat("tensor ", tensor.name(), " has ", tensor.num_elements(),
                                " elements but its shape gives ", n));
      }
      if (tensor.compute_dtype() == layercast::v1::DTYPE_UNSPECIFIED ||
          !layercast::v1::DType_IsValid(tensor.compute_dtype())) {
        return Bad(absl::StrCat("tensor ", tensor.name(), " has no valid compute dtype"));
      }
      const auto dtype = static_cast<DType>(tensor.compute_dtype());
      const DType policy_dtype = view.policy.ComputeDTypeFor(tensor.name());
      if (dtype != held.value_or(policy_dtype)) {
        return Bad(absl::StrCat("tensor ", tensor.name(), " is ", DTypeName(dtype), " but ",
                                held ? "the held_dtype is " : "the policy gives ",
                                DTypeName(held.value_or(policy_dtype))));
      }
      spec.tensors.push_back(
          TensorSpec{tensor.name(), {tensor.shape().begin(), tensor.shape().end()}, n});
      dtypes.push_back(policy_dtype);
      counts.push_back(n);
    }
    // The checked layout, not the manifest's own figures: a forger can make
    // offsets, sizes and digest agree with arithmetic that wrapped.
    absl::StatusOr<AssembledLayout> checked =
        AssembledLayout::FromDTypes(dtypes, counts, view.policy.fp8_block());
    if (!checked.ok()) {
      return Bad(absl::StrCat("layer ", l, " (", layer.name(), "): ", checked.status().message()));
    }
    AssembledLayout layout = *std::move(checked);
    std::optional<AssembledLayout> held_layout;
    if (held) {
      absl::StatusOr<AssembledLayout> in_held = LayoutIn(layout, *held, view.policy.fp8_block());
      if (!in_held.ok()) {
        return Bad(absl::StrCat("layer ", l, " (", layer.name(),
                                ") in its held_dtype: ", in_held.status().message()));
      }
      held_layout = *std::move(in_held);
    }
    const AssembledLayout& listed = held_layout ? *held_layout : layout;
    if (listed.total_bytes() != layer.assembled_bytes()) {
      return Bad(absl::StrCat("layer ", l, " says ", layer.assembled_bytes(),
                              " assembled bytes, the layout gives ", listed.total_bytes()));
    }
    for (int t = 0; t < layer.tensors_size(); ++t) {
      if (listed.tensors()[t].byte_offset != layer.tensors(t).byte_offset()) {
        return Bad(absl::StrCat("tensor ", layer.tensors(t).name(), " says offset ",
                                layer.tensors(t).byte_offset(), ", the layout gives ",
                                listed.tensors()[t].byte_offset));
      }
      if (listed.tensors()[t].block_size != layer.tensors(t).block_size() ||
          listed.tensors()[t].scale_offset != layer.tensors(t).scale_offset()) {
        return Bad(absl::StrCat(
            "tensor ", layer.tensors(t).name(), " says blocks of ", layer.tensors(t).block_size(),
            " with scales at ", layer.tensors(t).scale_offset(), ", the layout gives ",
            listed.tensors()[t].block_size, " at ", listed.tensors()[t].scale_offset));
      }
    }
    // Shards that each quantized part of a block would send two scales for
    // it, and the last to land would win.
    for (const AssembledLayout* cut : {&layout, held_layout ? &*held_layout : nullptr}) {
      if (cut == nullptr) continue;
      if (absl::Status blocks = CheckBlocksWithinShards(spec, *cut, view.num_shards);
          !blocks.ok()) {
        return Bad(blocks.message());
      }
    }
    absl::StatusOr<AssembledLayout> gradient = GradientLayout(layout);
    if (!gradient.ok()) {
      return Bad(absl::StrCat("layer ", l, " (", layer.name(),
                              ")'s gradient: ", gradient.status().message()));
    }
    view.model.layers.push_back(std::move(spec));
    view.layouts.push_back(std::move(layout));
    view.gradient_layouts.push_back(*std::move(gradient));
  }
  const absl::StatusOr<std::array<uint8_t, 32>> digest = LayoutDigest(view.model, view.policy);
  if (!digest.ok()) return Bad(digest.status().message());  // the layouts above were built
  if (manifest.layout_digest() != std::string(digest->begin(), digest->end())) {
    return Bad("its layout_digest does not match its layers");
  }
  return view;
}

absl::StatusOr<ShardSetView> CheckShardSet(const std::vector<layercast::v1::Manifest>& manifests,
                                           const std::vector<std::string>& addresses) {
  if (manifests.empty() || manifests.size() != addresses.size()) {
    return absl::InvalidArgumentError("a shard set needs one manifest per address");
  }
  const layercast::v1::Manifest& first = manifests[0];
  const auto name = [&](size_t i) {
    return absl::StrCat("shard ", addresses[i], " (position ", i, ")");
  };
  const auto disagree = [&](size_t i, absl::string_view what) {
    return absl::FailedPreconditionError(
        absl::StrCat(name(i), " does not belong to this shard set: ", what,
                     ". List every shard of one set, in shard order, in --shards"));
  };
  // The shard count and the order first: each is one mistake of the whole
  // list, said once, with what to do.
  std::vector<std::string> counts;
  bool counts_differ = false;
  for (size_t i = 0; i < manifests.size(); ++i) {
    counts.push_back(absl::StrCat(addresses[i], " says ", manifests[i].num_shards()));
    counts_differ |= manifests[i].num_shards() != first.num_shards();
  }
  if (counts_differ) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shards disagree on how many shards the set has (",
                     absl::StrJoin(counts, ", "), "): restart them all with one --num-shards"));
  }
  if (first.num_shards() != addresses.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "every shard says the set has ", first.num_shards(), " shards, but --shards lists ",
        addresses.size(), ": list all ", first.num_shards(), ", in shard order"));
  }
  std::vector<std::string> in_order(addresses.size());
  bool permuted = true;
  for (size_t i = 0; i < manifests.size(); ++i) {
    const uint32_t index = manifests[i].shard_index();
    if (index >= in_order.size() || !in_order[index].empty()) {
      permuted = false;
      break;
    }
    in_order[index] = addresses[i];
  }
  if (permuted && in_order != addresses) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--shards lists the shards out of order (each reports its index); in shard order: ",
        absl::StrJoin(in_order, ",")));
  }
  ShardSetView view;
  for (size_t i = 0; i < manifests.size(); ++i) {
    const layercast::v1::Manifest& m = manifests[i];
    absl::StatusOr<ShardSetView> own = CheckManifest(m);
    if (!own.ok())
      return absl::FailedPreconditionError(absl::StrCat(name(i), ": ", own.status().message()));
    if (m.num_shards() != addresses.size()) {
      return disagree(i, absl::StrCat("it is one of ", m.num_shards(), " shards, but ",
                                      addresses.size(), " addresses were given"));
    }
    if (m.shard_index() != i) {
      for (size_t j = 0; j < i; ++j) {
        if (manifests[j].shard_index() == m.shard_index()) {
          return disagree(i, absl::StrCat("it has shard index ", m.shard_index(), ", like ",
                                          addresses[j], " (each index must appear exactly once)"));
        }
      }
      return disagree(i, absl::StrCat("it has shard index ", m.shard_index(), ", not ", i));
    }
    if (m.model_id() != first.model_id()) {
      return disagree(i, absl::StrCat("it serves model '", m.model_id(), "', shard 0 serves '",
                                      first.model_id(), "'"));
    }
    if (m.policy() != first.policy()) {
      return disagree(
          i, absl::StrCat("its policy is '", m.policy(), "', shard 0's is '", first.policy(), "'"));
    }
    if (m.content_fingerprint() != first.content_fingerprint()) {
      return disagree(
          i, absl::StrCat("it serves other parameter values: its content fingerprint ",
                          absl::BytesToHexString(m.content_fingerprint()).substr(0, 16),
                          "... differs from shard 0's ",
                          absl::BytesToHexString(first.content_fingerprint()).substr(0, 16),
                          "... (another checkpoint or training step of the same model?)"));
    }
    if (m.layout_digest() != first.layout_digest()) {
      return disagree(
          i, absl::StrCat("its layout digest ",
                          absl::BytesToHexString(m.layout_digest()).substr(0, 16),
                          "... differs from shard 0's ",
                          absl::BytesToHexString(first.layout_digest()).substr(0, 16), "..."));
    }
    if (i == 0) view = *std::move(own);
  }
  return view;
}

}  // namespace layercast::wire
