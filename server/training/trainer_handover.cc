#include "server/training/trainer_handover.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace layercast::server {

absl::Status TrainerHandOver::Freeze(uint64_t version) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // Every layer's lock, as a checkpoint takes them: no push is between its
  // check and its staging while the freeze is decided.
  const TrainerLayers::Paused paused(layers_);
  const uint64_t frozen = layers_.frozen_at();
  if (frozen != TrainerLayers::kNoPush && frozen != version) {
    return absl::FailedPreconditionError(
        absl::StrCat("this shard is handing over at version ", frozen, ", not ", version,
                     ": ask every shard of the set for the same version (or Unfreeze first)"));
  }
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const TrainerLayers::Layer* const layer = &layers_.layer(l);
    const uint64_t at = layers_.VersionLocked(*layer);
    const bool begun =
        at == version && (layer->reduced ||
                          std::any_of(layer->pushed.begin(), layer->pushed.end(),
                                      [](const auto& pushed) { return pushed.has_value(); }) ||
                          std::any_of(layer->in_flight.begin(), layer->in_flight.end(),
                                      [&](uint64_t step) { return step == version; }));
    if (at > version || begun) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", layer->index, " is at version ", at,
                       begun ? " with its next step begun" : "", ", past a hand-over at version ",
                       version, ": hand over at version ", begun ? at + 1 : at, " or later"));
    }
  }
  layers_.set_frozen_at(version);
  return absl::OkStatus();
}

std::optional<uint64_t> TrainerHandOver::frozen_at() const {
  const uint64_t frozen = layers_.frozen_at();
  return frozen == TrainerLayers::kNoPush ? std::nullopt : std::optional<uint64_t>(frozen);
}

bool TrainerHandOver::AtFrozenBoundary() const {
  const uint64_t frozen = layers_.frozen_at();
  if (frozen == TrainerLayers::kNoPush) return false;
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const TrainerLayers::Layer& layer = layers_.layer(l);
    absl::MutexLock lock(&layer.mu);
    if (layers_.VersionLocked(layer) != frozen || layer.reduced) return false;
    for (uint32_t w = 0; w < layers_.workers(); ++w) {
      if (layer.pushed[w].has_value() || layer.in_flight[w] != TrainerLayers::kNoPush) return false;
    }
  }
  return true;
}

absl::Status TrainerHandOver::ReadFrozen(uint32_t layer, uint32_t tensor, const std::string& buffer,
                                         ElementRange range, std::span<float> dst) const {
  if (!AtFrozenBoundary()) {
    return absl::FailedPreconditionError(
        "this shard is not frozen at a step boundary, so its state may still change: call "
        "HandOver with at_version on every shard of the set until each answers at_boundary");
  }
  if (layer >= layers_.size() || tensor >= layers_.store().model().layers[layer].tensors.size()) {
    return absl::NotFoundError(absl::StrCat("no tensor ", tensor, " of layer ", layer, " in model ",
                                            layers_.store().model().model_id));
  }
  const ElementRange owned = layers_.store().owned(layer, tensor);
  if (range.begin < owned.begin || range.end > owned.end || range.begin > range.end ||
      dst.size() != range.size()) {
    return absl::OutOfRangeError(
        absl::StrCat("elements [", range.begin, ", ", range.end, ") of tensor ", tensor,
                     " of layer ", layer, " are not all this shard's (it holds [", owned.begin,
                     ", ", owned.end, ")): ask the shard whose slice holds them"));
  }
  const uint64_t skip = range.begin - owned.begin;
  if (buffer.empty()) {
    absl::ReaderMutexLock lock(&layers_.store().layer_mutex(layer));
    std::memcpy(dst.data(), layers_.store().master(layer, tensor) + skip,
                range.size() * sizeof(float));
    return absl::OkStatus();
  }
  const TrainerLayers::Layer& state = layers_.layer(layer);
  absl::MutexLock lock(&state.mu);
  if (tensor < state.optimizers.size()) {
    for (const auto& [name, values] : state.optimizers[tensor].StateBuffers()) {
      if (buffer != name) continue;
      std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(skip), range.size(), dst.begin());
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(absl::StrCat("tensor ", tensor, " of layer ", layer,
                                          " keeps no optimizer buffer ", buffer, " under ",
                                          layers_.spec().ToString()));
}

}  // namespace layercast::server
