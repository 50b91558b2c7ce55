#include "server/training/layer_trainer.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <new>
#include <span>

#include "absl/numeric/int128.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "platform/byte_size.h"
#include "platform/failpoint.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"

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
    for (uint32_t l = 0; l < model.layers.size(); ++l) {
      auto state = std::make_unique<LayerState>();
      state->index = l;
      absl::MutexLock lock(&state->mu);
      state->pushed.resize(workers);
      state->in_flight.assign(workers, kNoPush);
      for (uint32_t t = 0; t < model.layers[l].tensors.size(); ++t) {
        const uint64_t owned = store.owned(l, t).size();
        state->owned_elements += owned;
        state->optimizers.emplace_back(
            trainer->spec_.kind(), trainer->spec_.HyperFor(model.layers[l].tensors[t].name), owned);
      }
      trainer->layers_.push_back(std::move(state));
    }
  } catch (const std::bad_alloc&) {
    // TensorOptimizer keeps its state in std::vector; a start-up budget check
    // (StateBytes) should have refused this first.
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate ", StateBytes(store, trainer->spec_),
        " bytes of optimizer state: lower --memory-budget's other uses or add shards"));
  }
  return trainer;
}

uint64_t LayerTrainer::version(uint32_t layer) const { return links_.gate->version(layer); }

uint32_t LayerTrainer::MissingLocked(const LayerState& state) {
  // A reduced step (clipping) has every push; it waits for its scale.
  if (state.reduced) return 0;
  return static_cast<uint32_t>(
      std::count_if(state.pushed.begin(), state.pushed.end(),
                    [](const auto& pushed) { return !pushed.has_value(); }));
}

uint32_t LayerTrainer::missing_workers(uint32_t layer) const {
  const LayerState& state = *layers_[layer];
  absl::MutexLock lock(&state.mu);
  return MissingLocked(state);
}

std::string LayerTrainer::WaitingFor(uint32_t layer) const {
  const LayerState& state = *layers_[layer];
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

absl::Status LayerTrainer::CheckIndices(uint32_t layer, uint32_t worker) const {
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

absl::Status LayerTrainer::CheckStepLocked(uint32_t layer, uint32_t worker, uint64_t step,
                                           const LayerState& state) const {
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

absl::StatusOr<LayerTrainer::Pushed> LayerTrainer::Push(uint32_t layer, uint32_t worker,
                                                        uint64_t step,
                                                        std::vector<float> gradient) {
  RETURN_IF_ERROR(CheckIndices(layer, worker));
  LayerState& state = *layers_[layer];
  if (gradient.size() != state.owned_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("a gradient of ", gradient.size(), " values for layer ", layer,
                     ", of which this shard owns ", state.owned_elements, " elements"));
  }
  absl::MutexLock lock(&state.mu);
  RETURN_IF_ERROR(CheckStepLocked(layer, worker, step, state));
  // Before it is taken, under the layer's lock: a checkpoint (which holds
  // every lock while it starts a journal generation) has either both the
  // record and the push, or neither. Under --journal-sync every-push or
  // grouped the append returns once the record is synced, so a push whose
  // sync fails is not taken; other layers' pushes go on meanwhile, and
  // under grouped share that sync.
  if (journal_ != nullptr) {
    RETURN_IF_ERROR(journal_->AppendPush(layer, worker, step, gradient));
    FailPoint("step.after_journal", store_.shard_index());
  }
  return TakeLocked(layer, worker, state, std::move(gradient));
}

absl::StatusOr<LayerTrainer::Pushed> LayerTrainer::TakeLocked(uint32_t layer, uint32_t worker,
                                                              LayerState& state,
                                                              std::vector<float> gradient) {
  const auto start = std::chrono::steady_clock::now();
  state.pushed[worker] = std::move(gradient);
  if (!state.opened) state.opened = start;
  for (const auto& pushed : state.pushed) {
    if (!pushed.has_value()) return Pushed{VersionLocked(state), false};
  }
  if (spec_.clip()) {
    // The step waits for the clip scale, which needs every layer's norm.
    ReduceLocked(state);
    return Pushed{VersionLocked(state), false};
  }
  const auto opened = *state.opened;
  if (absl::Status applied = ApplyLocked(layer, state, std::nullopt); !applied.ok()) {
    // Nothing was reduced or stepped: the push is not taken.
    state.pushed[worker].reset();
    if (std::none_of(state.pushed.begin(), state.pushed.end(),
                     [](const auto& pushed) { return pushed.has_value(); })) {
      state.opened.reset();
    }
    return applied;
  }
  const auto end = std::chrono::steady_clock::now();
  return Pushed{VersionLocked(state), true, std::chrono::duration<double>(end - start).count(),
                std::chrono::duration<double>(end - opened).count()};
}

double LayerTrainer::SumOfSquares(const std::vector<float>& mean) {
  double sum = 0;
  for (const float value : mean) sum += static_cast<double>(value) * value;
  return sum;
}

void LayerTrainer::ReduceLocked(LayerState& state) {
  // Left to right in worker order: the same bits whatever order pushes came
  // in. Summed into worker 0's staging, which the step consumes anyway.
  float* __restrict const mean = state.pushed[0]->data();
  const size_t size = state.pushed[0]->size();
  for (uint32_t w = 1; w < workers_; ++w) {
    const float* __restrict const g = state.pushed[w]->data();
    for (size_t i = 0; i < size; ++i) mean[i] += g[i];
    RecycleLocked(state, *std::move(state.pushed[w]));
    state.pushed[w].reset();
  }
  // x / 1 is x, bit for bit: one worker's gradient is its own mean.
  if (workers_ > 1) {
    const float divisor = static_cast<float>(workers_);
    for (size_t i = 0; i < size; ++i) mean[i] /= divisor;
  }
  if (spec_.clip()) state.sum_of_squares = SumOfSquares(*state.pushed[0]);
  state.reduced = true;
}

absl::Status LayerTrainer::ApplyLocked(uint32_t layer, LayerState& state,
                                       std::optional<float> clip_scale) {
  // All or nothing: every tensor's learning rate is checked before any
  // tensor steps, so a step either applies whole or leaves the layer as it
  // was, its pushes still staged.
  const uint64_t step = VersionLocked(state) + 1;  // 1-based, as torch counts
  std::vector<double> lrs;
  for (const TensorOptimizer& optimizer : state.optimizers) {
    const double lr = spec_.LearningRate(optimizer.hyper(), step);
    if (!std::isfinite(lr) || lr < 0) {
      return absl::InternalError(
          absl::StrCat("--optimizer ", spec_.ToString(), " gives learning rate ", lr, " at step ",
                       step, " for tensor ", store_.model().layers[layer].tensors[lrs.size()].name,
                       ": check its lr, warmup_steps, decay_steps and min_lr"));
    }
    lrs.push_back(lr);
  }
  if (!state.reduced) ReduceLocked(state);
  std::vector<float>& mean = *state.pushed[0];
  // As torch's clip_grad_norm_ does to p.grad: one float multiply each.
  if (clip_scale) {
    for (float& value : mean) value *= *clip_scale;
  }

  // Taken here, where the analysis sees state.mu held: the lambda runs
  // within this call, which the analysis cannot follow.
  std::vector<TensorOptimizer>& optimizers = *&state.optimizers;
  RETURN_IF_ERROR(master_.Step(layer, VersionLocked(state), [&](ChangeLog::Recording* recording) {
    uint64_t at = 0;
    for (uint32_t t = 0; t < optimizers.size(); ++t) {
      TensorOptimizer& optimizer = optimizers[t];
      const std::span<float> master(store_.mutable_master(layer, t), optimizer.size());
      // Cannot fail: sizes match by construction and the lr was checked above.
      RETURN_IF_ERROR(optimizer.Step(lrs[t], master,
                                     std::span<const float>(mean.data() + at, optimizer.size()),
                                     recording != nullptr ? recording->ForTensor(t) : nullptr));
      at += optimizer.size();
      // A death with some tensors stepped: the restart takes the layer from
      // the checkpoint and the journal, never from this half.
      if (t == 0 && optimizers.size() > 1) FailPoint("step.mid_apply", store_.shard_index());
    }
    return absl::OkStatus();
  }));
  RecycleLocked(state, *std::move(state.pushed[0]));
  state.pushed[0].reset();
  // Left only by pushes that brought their own buffers (Push called
  // directly): the step's charge went with the W recycled above.
  state.spare.clear();
  state.reduced = false;
  state.opened.reset();
  state.reserved = false;
  return absl::OkStatus();
}

LayerTrainer::StepNorm LayerTrainer::NormOfStep(uint64_t step) const {
  StepNorm norm;
  norm.max_norm = spec_.clip().value_or(0);
  {
    absl::MutexLock lock(&clip_mu_);
    if (last_clip_ && last_clip_->first == step) norm.applied_scale = last_clip_->second;
  }
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const LayerState& state = *layers_[l];
    absl::MutexLock lock(&state.mu);
    const uint64_t version = VersionLocked(state);
    if (version == step && state.reduced) {
      norm.sum_of_squares += state.sum_of_squares;
    } else if (version <= step) {
      norm.waiting_layers.push_back(l);
    }
  }
  norm.ready = norm.waiting_layers.empty();
  return norm;
}

absl::StatusOr<uint64_t> LayerTrainer::ApplyClippedStep(uint64_t step, float scale) {
  if (!spec_.clip()) {
    return absl::FailedPreconditionError(
        "this shard's optimizer does not clip (no clip= in --optimizer): its steps apply as "
        "their pushes complete");
  }
  if (!std::isfinite(scale) || scale < 0 || scale > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("clip scale ", scale,
                     " is not in [0, 1]: the model's gradient norm is not finite; "
                     "nothing was applied (find the worker whose gradients overflowed)"));
  }
  absl::MutexLock clip_lock(&clip_mu_);
  // A step applied (or begun) with a scale keeps it: a second call, such as
  // a restarted worker 0's with a scale it computed afresh, applies and
  // reports the first one, so no two layers or shards step with two.
  if (last_clip_ && last_clip_->first == step) scale = last_clip_->second;
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const LayerState& state = *layers_[l];
    absl::MutexLock lock(&state.mu);
    const uint64_t version = VersionLocked(state);
    if (version == step + 1 || (version == step && state.reduced)) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", l, " is at version ", version, " and ",
        version == step ? "still waits for pushes" : "not at this step", ": a clipped step ", step,
        " applies once every layer has every worker's push"));
  }
  if (journal_ != nullptr && !(last_clip_ && last_clip_->first == step)) {
    RETURN_IF_ERROR(journal_->AppendClipScale(step, scale));
  }
  // Before any layer applies: should one fail, a retry still learns the
  // scale the others used.
  last_clip_ = std::make_pair(step, scale);
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    LayerState& state = *layers_[l];
    absl::MutexLock lock(&state.mu);
    if (VersionLocked(state) == step + 1) continue;  // applied by an earlier call
    RETURN_IF_ERROR(ApplyLocked(l, state, scale));
  }
  return step + 1;
}

}  // namespace layercast::server
