#include "server/training/trainer_layers.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace layercast::server {

void TrainerLayers::AddLayers() {
  const ModelSpec& model = store_.model();
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    auto state = std::make_unique<Layer>();
    state->index = l;
    absl::MutexLock lock(&state->mu);
    state->pushed.resize(workers_);
    state->in_flight.assign(workers_, kNoPush);
    for (uint32_t t = 0; t < model.layers[l].tensors.size(); ++t) {
      const uint64_t owned = store_.owned(l, t).size();
      state->owned_elements += owned;
      state->optimizers.emplace_back(spec_.kind(), spec_.HyperFor(model.layers[l].tensors[t].name),
                                     owned);
    }
    layers_.push_back(std::move(state));
  }
}

TrainerLayers::Paused::Paused(const TrainerLayers& layers) : all_(&layers.all_mu_) {
  for (const auto& layer : layers.layers_) {
    layers_.push_back(std::make_unique<absl::MutexLock>(&layer->mu));
  }
}

uint32_t TrainerLayers::MissingLocked(const Layer& state) {
  // A reduced step (clipping) has every push; it waits for its scale.
  if (state.reduced) return 0;
  return static_cast<uint32_t>(
      std::count_if(state.pushed.begin(), state.pushed.end(),
                    [](const auto& pushed) { return !pushed.has_value(); }));
}

uint32_t TrainerLayers::missing_workers(uint32_t layer) const {
  const Layer& state = *layers_[layer];
  absl::MutexLock lock(&state.mu);
  return MissingLocked(state);
}

std::string TrainerLayers::WaitingFor(uint32_t layer) const {
  const Layer& state = *layers_[layer];
  // Asked on the shard's timer thread, which must not wait out a step that
  // holds the layer.
  if (!state.mu.TryLock()) {
    return absl::StrCat("layer ", layer, "'s step is being applied right now; ask again");
  }
  const uint64_t step = VersionLocked(state);
  const bool reduced = state.reduced;
  std::vector<uint32_t> missing, pushed;
  for (uint32_t w = 0; w < workers_; ++w) {
    (state.pushed[w].has_value() ? pushed : missing).push_back(w);
  }
  state.mu.Unlock();
  if (reduced) {
    return absl::StrCat("every worker pushed layer ", layer, "'s step ", step,
                        "; it waits for the step's clip scale, which worker 0 sends once every "
                        "layer of the step is in (its finish_step)");
  }
  return absl::StrCat("layer ", layer, "'s step ", step, " waits for the push of worker",
                      missing.size() == 1 ? " " : "s ", absl::StrJoin(missing, ", "), " of the ",
                      workers_, " the shards train with (--data-parallel-workers)",
                      pushed.empty() ? ""
                                     : absl::StrCat("; worker", pushed.size() == 1 ? " " : "s ",
                                                    absl::StrJoin(pushed, ", "), " pushed"),
                      ": is every worker running, each with its own index?");
}

TrainerLayers::OpenStep TrainerLayers::OldestOpenStep() const {
  const auto now = std::chrono::steady_clock::now();
  OpenStep oldest;
  std::optional<std::chrono::steady_clock::time_point> oldest_opened;
  for (const auto& layer : layers_) {
    // Skipped while a step or a checkpoint holds it: a gauge can wait.
    if (!layer->mu.TryLock()) continue;
    if (layer->opened && (!oldest_opened || *layer->opened < *oldest_opened)) {
      oldest_opened = layer->opened;
      oldest.waited_seconds = std::chrono::duration<double>(now - *layer->opened).count();
      oldest.missing_workers = MissingLocked(*layer);
    }
    layer->mu.Unlock();
  }
  return oldest;
}

absl::Status TrainerLayers::CheckIndices(uint32_t layer, uint32_t worker) const {
  if (layer >= layers_.size()) {
    return absl::NotFoundError(absl::StrCat("layer ", layer, " does not exist: this model has ",
                                            layers_.size(), " layers"));
  }
  if (worker >= workers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", worker, " is out of range: this shard set trains with ", workers_,
                     " data-parallel workers (0-", workers_ - 1,
                     "); give each worker its own index below --data-parallel-workers"));
  }
  return absl::OkStatus();
}

absl::Status TrainerLayers::CheckStepLocked(uint32_t layer, uint32_t worker, uint64_t step,
                                            const Layer& state) const {
  if (const uint64_t frozen = frozen_at_.load(); step >= frozen) {
    return absl::FailedPreconditionError(
        absl::StrCat("this shard set is handing over to a new set at version ", frozen,
                     " and takes no push for step ", step,
                     ": reconnect to the new set's addresses and push step ", step, " there"));
  }
  const uint64_t version = VersionLocked(state);
  if (step < version) {
    return absl::AlreadyExistsError(
        absl::StrCat("step ", step, " of layer ", layer,
                     " was applied already (the layer is at version ", version, "): worker ",
                     worker, "'s push for it counted once; go on from version ", version));
  }
  if (step > version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a gradient for step ", step, " of layer ", layer, ", which is at version ", version,
        ": compute gradients on the layer as gathered at its current version"));
  }
  if (state.reduced || state.pushed[worker].has_value()) {
    return absl::AlreadyExistsError(absl::StrCat(
        "worker ", worker, " pushed layer ", layer, " for step ", step,
        " already; it counts once (if that worker did not push it, two workers share index ",
        worker, ")"));
  }
  return absl::OkStatus();
}

}  // namespace layercast::server
