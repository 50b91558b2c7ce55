#include "server/serving/parameter_store.h"

#include <random>

#include <new>

#include "absl/strings/str_cat.h"
#include "platform/status_macros.h"

namespace layercast::server {

absl::StatusOr<uint64_t> ParameterStore::MasterBytes(const ModelSpec& model, uint32_t shard_index,
                                                     uint32_t num_shards) {
  uint64_t elements = 0, bytes = 0;
  double approximate = 0;  // for the message, when the exact figure does not fit
  bool wrapped = false;
  for (const LayerSpec& layer : model.layers) {
    for (const TensorSpec& tensor : layer.tensors) {
      const uint64_t owned = ShardElementRange(tensor.num_elements, shard_index, num_shards).size();
      wrapped |= __builtin_add_overflow(elements, owned, &elements);
      approximate += static_cast<double>(owned);
    }
  }
  if (!wrapped && !__builtin_mul_overflow(elements, sizeof(float), &bytes)) return bytes;
  return absl::InvalidArgumentError(
      absl::StrCat("model '", model.model_id, "' is too large: shard ", shard_index, " of ",
                   num_shards, " would hold about ", absl::SixDigits(approximate * sizeof(float)),
                   " bytes of fp32 master, more than a 64-bit size can count (", UINT64_MAX, ")"));
}

absl::StatusOr<std::unique_ptr<ParameterStore>> ParameterStore::Load(
    const ParameterSource& source, uint32_t shard_index, uint32_t num_shards, Policy policy,
    const std::atomic<bool>* cancel) {
  auto store = std::unique_ptr<ParameterStore>(new ParameterStore());
  store->model_ = source.model();
  store->policy_ = std::move(policy);
  store->shard_index_ = shard_index;
  store->num_shards_ = num_shards;
  std::random_device random;
  do {
    store->incarnation_ = uint64_t{random()} << 32 | random();
  } while (store->incarnation_ == 0);
  const std::vector<LayerSpec>& layers = store->model_.layers;
  ASSIGN_OR_RETURN(store->layouts_, ShardedLayouts(store->model_, store->policy_, num_shards));
  ASSIGN_OR_RETURN(store->layout_digest_, LayoutDigest(store->model_, store->policy_));
  ASSIGN_OR_RETURN(store->master_bytes_, MasterBytes(store->model_, shard_index, num_shards));
  ASSIGN_OR_RETURN(store->content_fingerprint_, source.Fingerprint());

  store->slices_.resize(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    store->layer_mutexes_.push_back(std::make_unique<absl::Mutex>());
  }
  for (uint32_t l = 0; l < layers.size(); ++l) {
    for (uint32_t t = 0; t < layers[l].tensors.size(); ++t) {
      if (cancel != nullptr && cancel->load(std::memory_order_relaxed)) {
        return absl::CancelledError("loading was cancelled: the server is stopping");
      }
      Slice slice;
      slice.owned = ShardElementRange(layers[l].tensors[t].num_elements, shard_index, num_shards);
      // Not value-initialised: Read() writes every element, and untouched
      // pages would otherwise be zero-filled once here and again there.
      slice.values.reset(new (std::nothrow) float[slice.owned.size()]);
      if (slice.values == nullptr) {
        return absl::ResourceExhaustedError(
            absl::StrCat("cannot allocate ", slice.owned.size() * sizeof(float),
                         " bytes for the fp32 master of tensor ", layers[l].tensors[t].name,
                         ": use more shards, or a host with more memory"));
      }
      absl::Status read =
          source.Read(l, t, slice.owned, std::span<float>(slice.values.get(), slice.owned.size()));
      if (!read.ok()) {
        return absl::Status(read.code(), absl::StrCat("loading tensor ", layers[l].tensors[t].name,
                                                      ": ", read.message()));
      }
      store->slices_[l].push_back(std::move(slice));
    }
  }
  return store;
}

}  // namespace layercast::server
