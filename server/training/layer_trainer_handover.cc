#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "server/training/layer_trainer.h"

// LayerTrainer's side of a live hand-over: the freeze that stops its state
// at a step boundary, and the reads a new set fills itself with.

namespace layercast::server {

absl::Status LayerTrainer::Freeze(uint64_t version) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  // Every layer's lock, as a checkpoint takes them: no push is between its
  // check and its staging while the freeze is decided.
  absl::MutexLock clip_lock(&clip_mu_);
  std::vector<std::unique_ptr<absl::MutexLock>> locks;
  for (auto& layer : layers_) locks.push_back(std::make_unique<absl::MutexLock>(&layer->mu));
  const uint64_t frozen = frozen_at_.load();
  if (frozen != kNoPush && frozen != version) {
    return absl::FailedPreconditionError(
        absl::StrCat("this shard is handing over at version ", frozen, ", not ", version,
                     ": ask every shard of the set for the same version (or Unfreeze first)"));
  }
  for (const auto& layer : layers_) {
    const uint64_t at = VersionLocked(*layer);
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
  frozen_at_.store(version);
  return absl::OkStatus();
}

std::optional<uint64_t> LayerTrainer::frozen_at() const {
  const uint64_t frozen = frozen_at_.load();
  return frozen == kNoPush ? std::nullopt : std::optional<uint64_t>(frozen);
}

bool LayerTrainer::AtFrozenBoundary() const {
  const uint64_t frozen = frozen_at_.load();
  if (frozen == kNoPush) return false;
  for (const auto& layer : layers_) {
    absl::MutexLock lock(&layer->mu);
    if (VersionLocked(*layer) != frozen || layer->reduced) return false;
    for (uint32_t w = 0; w < workers_; ++w) {
      if (layer->pushed[w].has_value() || layer->in_flight[w] != kNoPush) return false;
    }
  }
  return true;
}

CheckpointTraining LayerTrainer::TrainingHeader() const {
  CheckpointTraining header;
  header.optimizer = spec_.ToString();
  header.workers = workers_;
  for (const auto& layer : layers_) {
    absl::MutexLock lock(&layer->mu);
    header.layer_versions.push_back(VersionLocked(*layer));
    header.optimizer_steps.push_back(layer->optimizers.empty() ? 0 : layer->optimizers[0].steps());
  }
  absl::MutexLock clip_lock(&clip_mu_);
  header.last_clip = last_clip_;
  return header;
}

absl::Status LayerTrainer::ReadFrozen(uint32_t layer, uint32_t tensor, const std::string& buffer,
                                      ElementRange range, std::span<float> dst) const {
  if (!AtFrozenBoundary()) {
    return absl::FailedPreconditionError(
        "this shard is not frozen at a step boundary, so its state may still change: call "
        "HandOver with at_version on every shard of the set until each answers at_boundary");
  }
  if (layer >= layers_.size() || tensor >= store_.model().layers[layer].tensors.size()) {
    return absl::NotFoundError(absl::StrCat("no tensor ", tensor, " of layer ", layer, " in model ",
                                            store_.model().model_id));
  }
  const ElementRange owned = store_.owned(layer, tensor);
  if (range.begin < owned.begin || range.end > owned.end || range.begin > range.end ||
      dst.size() != range.size()) {
    return absl::OutOfRangeError(
        absl::StrCat("elements [", range.begin, ", ", range.end, ") of tensor ", tensor,
                     " of layer ", layer, " are not all this shard's (it holds [", owned.begin,
                     ", ", owned.end, ")): ask the shard whose slice holds them"));
  }
  const uint64_t skip = range.begin - owned.begin;
  if (buffer.empty()) {
    absl::ReaderMutexLock lock(&store_.layer_mutex(layer));
    std::memcpy(dst.data(), store_.master(layer, tensor) + skip, range.size() * sizeof(float));
    return absl::OkStatus();
  }
  const LayerState& state = *layers_[layer];
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
                                          spec_.ToString()));
}

}  // namespace layercast::server
