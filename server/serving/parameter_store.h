#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/layout.h"
#include "core/model.h"
#include "core/parameter_source.h"
#include "core/policy.h"

namespace layercast::server {

// The fp32 master parameters of one shard: for every tensor of every layer,
// the contiguous elements this shard owns, and nothing else. Also the
// per-layer assembled layouts and the layout digest derived from the model and
// policy, computed once.
//
// Thread-safety: reads may run concurrently from any thread. After Load()
// only a LayerTrainer (an optimizer step) or Publications (a committed
// publish) changes the master, one layer at a time, holding that layer's
// layer_mutex() exclusively; whoever reads a layer that may change holds
// it shared. (The versions live in VersionGate.)
class ParameterStore {
 public:
  // Bytes of fp32 master that shard `shard_index` of `num_shards` holds for
  // `model`: what Load() will allocate. INVALID_ARGUMENT, with the figure, when
  // it would not fit in 64 bits. REQUIRES: shard_index < num_shards.
  static absl::StatusOr<uint64_t> MasterBytes(const ModelSpec& model, uint32_t shard_index,
                                              uint32_t num_shards);

  // Reads this shard's ranges from `source`. Returns CANCELLED as soon as
  // `*cancel` becomes true (checked between tensors), so a server told to stop
  // while loading exits promptly; INVALID_ARGUMENT for a model whose sizes do
  // not fit (see MasterBytes, AssembledLayout::Build); FAILED_PRECONDITION
  // for an fp8 tensor whose blocks the shards would split
  // (CheckBlocksWithinShards); RESOURCE_EXHAUSTED when
  // a tensor's master cannot be allocated. REQUIRES: shard_index < num_shards.
  static absl::StatusOr<std::unique_ptr<ParameterStore>> Load(
      const ParameterSource& source, uint32_t shard_index, uint32_t num_shards, Policy policy,
      const std::atomic<bool>* cancel = nullptr);

  const ModelSpec& model() const { return model_; }
  const Policy& policy() const { return policy_; }
  uint32_t shard_index() const { return shard_index_; }
  uint32_t num_shards() const { return num_shards_; }
  const std::array<uint8_t, 32>& layout_digest() const { return layout_digest_; }
  // The source's ParameterSource::Fingerprint(), read once at Load.
  const ContentFingerprint& content_fingerprint() const { return content_fingerprint_; }
  uint64_t master_bytes() const { return master_bytes_; }
  // Random and never 0, drawn at Load: which start of the shard holds these
  // values (Manifest.incarnation). A version names one set of values only
  // within one incarnation.
  uint64_t incarnation() const { return incarnation_; }

  // REQUIRES: layer < model().layers.size().
  const AssembledLayout& layout(uint32_t layer) const { return layouts_[layer]; }
  absl::Span<const AssembledLayout> layouts() const { return layouts_; }

  // The elements of a tensor this shard owns.
  ElementRange owned(uint32_t layer, uint32_t tensor) const { return slices_[layer][tensor].owned; }
  // The master values of owned(layer, tensor); element owned().begin first.
  const float* master(uint32_t layer, uint32_t tensor) const {
    return slices_[layer][tensor].values.get();
  }
  // The same values, for what changes them (LayerTrainer, Publications),
  // only while no reader casts that layer.
  float* mutable_master(uint32_t layer, uint32_t tensor) {
    return slices_[layer][tensor].values.get();
  }
  // Held shared while a layer's master is read (cast, checkpointed) and
  // exclusively while an optimizer step changes it, so a reader never sees
  // half a step.
  absl::Mutex& layer_mutex(uint32_t layer) const { return *layer_mutexes_[layer]; }

 private:
  struct Slice {
    ElementRange owned;
    std::unique_ptr<float[]> values;
  };

  ParameterStore() = default;

  ModelSpec model_;
  Policy policy_;
  uint32_t shard_index_ = 0;
  uint32_t num_shards_ = 1;
  std::array<uint8_t, 32> layout_digest_{};
  ContentFingerprint content_fingerprint_{};
  uint64_t master_bytes_ = 0;
  uint64_t incarnation_ = 0;
  std::vector<AssembledLayout> layouts_;
  std::vector<std::vector<Slice>> slices_;
  std::vector<std::unique_ptr<absl::Mutex>> layer_mutexes_;
};

}  // namespace layercast::server
