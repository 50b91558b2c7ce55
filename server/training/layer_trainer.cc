#include "server/training/layer_trainer.h"

#include <algorithm>
#include <new>

#include "absl/numeric/int128.h"
#include "absl/strings/str_cat.h"

namespace layercast::server {

uint64_t LayerTrainer::StateBytes(const ParameterStore& store, const OptimizerSpec& spec) {
  uint64_t floats = 0;
  const ModelSpec& model = store.model();
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    for (uint32_t t = 0; t < model.layers[l].tensors.size(); ++t) {
      const OptimizerHyper hyper = spec.HyperFor(model.layers[l].tensors[t].name);
      floats += StateFloatsPerElement(spec.kind(), hyper) * store.owned(l, t).size();
    }
  }
  return floats * sizeof(float);
}

LayerTrainer::Memory LayerTrainer::MemoryFor(const ModelSpec& model, uint32_t shard_index,
                                             uint32_t num_shards, const OptimizerSpec& spec,
                                             uint32_t workers) {
  // In 128 bits: a model whose master fits may still have twice as much state.
  absl::uint128 state = 0, largest_layer = 0, master_floats = 0;
  for (const LayerSpec& layer : model.layers) {
    absl::uint128 layer_floats = 0;
    for (const TensorSpec& tensor : layer.tensors) {
      const uint64_t owned = ShardElementRange(tensor.num_elements, shard_index, num_shards).size();
      state += absl::uint128(StateFloatsPerElement(spec.kind(), spec.HyperFor(tensor.name))) *
               owned * sizeof(float);
      layer_floats += owned;
    }
    largest_layer = std::max(largest_layer, layer_floats);
    master_floats += layer_floats;
  }
  const auto saturate = [](absl::uint128 value) {
    return value > UINT64_MAX ? UINT64_MAX : absl::Uint128Low64(value);
  };
  absl::uint128 staging = largest_layer * sizeof(float) * workers;
  if (spec.clip()) staging += master_floats * sizeof(float);
  return Memory{saturate(state), saturate(staging)};
}

absl::StatusOr<std::unique_ptr<LayerTrainer>> LayerTrainer::Create(ParameterStore& store,
                                                                   OptimizerSpec spec,
                                                                   uint32_t workers, Links links) {
  if (workers == 0) {
    return absl::InvalidArgumentError("--data-parallel-workers must be at least 1");
  }
  const ModelSpec& model = store.model();
  // The pool may keep as much staging as every layer's step can reserve at
  // once (W pushes of the shard's whole slice): it only ever holds buffers
  // the steps held at one time, and gives them up to anything that waits
  // for budget. Measured in bench/train_bench: with W workers every layer's
  // step is open at once while the last worker catches up, and a pool of
  // one step of the largest layer left most pushes faulting in fresh
  // buffers.
  uint64_t owned = 0;
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    for (uint32_t t = 0; t < model.layers[l].tensors.size(); ++t) owned += store.owned(l, t).size();
  }
  std::unique_ptr<OwnGate> own_gate;
  if (links.gate == nullptr) {
    own_gate = std::make_unique<OwnGate>();
    own_gate->gate.SetLayers(static_cast<uint32_t>(model.layers.size()));
    links.gate = &own_gate->gate;
  }
  auto trainer = std::unique_ptr<LayerTrainer>(
      new LayerTrainer(store, std::move(spec), workers, links,
                       uint64_t{workers} * owned * sizeof(float), std::move(own_gate)));
  try {
    trainer->layers_.AddLayers();
  } catch (const std::bad_alloc&) {
    // TensorOptimizer keeps its state in std::vector; a start-up budget check
    // (StateBytes) should have refused this first.
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate ", StateBytes(store, trainer->layers_.spec()),
        " bytes of optimizer state: lower --memory-budget's other uses or add shards"));
  }
  return trainer;
}

}  // namespace layercast::server
