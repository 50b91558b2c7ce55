#include "server/training/trainer_steps.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <span>

#include "absl/strings/str_cat.h"
#include "platform/failpoint.h"
#include "platform/status_macros.h"

namespace layercast::server {

using Layer = TrainerLayers::Layer;

absl::StatusOr<TrainerSteps::Pushed> TrainerSteps::Push(uint32_t layer, uint32_t worker,
                                                        uint64_t step,
                                                        std::vector<float> gradient) {
  RETURN_IF_ERROR(layers_.CheckIndices(layer, worker));
  Layer& state = layers_.layer(layer);
  if (gradient.size() != state.owned_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("a gradient of ", gradient.size(), " values for layer ", layer,
                     ", of which this shard owns ", state.owned_elements, " elements"));
  }
  absl::MutexLock lock(&state.mu);
  RETURN_IF_ERROR(layers_.CheckStepLocked(layer, worker, step, state));
  // Before it is taken, under the layer's lock: a checkpoint (which holds
  // every lock while it starts a journal generation) has either both the
  // record and the push, or neither. Under --journal-sync every-push or
  // grouped the append returns once the record is synced, so a push whose
  // sync fails is not taken; other layers' pushes go on meanwhile, and
  // under grouped share that sync.
  if (journal_ != nullptr) {
    RETURN_IF_ERROR(journal_->AppendPush(layer, worker, step, gradient));
    FailPoint("step.after_journal", layers_.store().shard_index());
  }
  return TakeLocked(layer, worker, state, std::move(gradient));
}

absl::StatusOr<TrainerSteps::Pushed> TrainerSteps::TakeLocked(uint32_t layer, uint32_t worker,
                                                              Layer& state,
                                                              std::vector<float> gradient) {
  const auto start = std::chrono::steady_clock::now();
  state.pushed[worker] = std::move(gradient);
  if (!state.opened) state.opened = start;
  for (const auto& pushed : state.pushed) {
    if (!pushed.has_value()) return Pushed{layers_.VersionLocked(state), false};
  }
  if (layers_.spec().clip()) {
    // The step waits for the clip scale, which needs every layer's norm.
    ReduceLocked(state);
    return Pushed{layers_.VersionLocked(state), false};
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
  return Pushed{layers_.VersionLocked(state), true,
                std::chrono::duration<double>(end - start).count(),
                std::chrono::duration<double>(end - opened).count()};
}

double TrainerSteps::SumOfSquares(const std::vector<float>& mean) {
  double sum = 0;
  for (const float value : mean) sum += static_cast<double>(value) * value;
  return sum;
}

void TrainerSteps::ReduceLocked(Layer& state) {
  // Left to right in worker order: the same bits whatever order pushes came
  // in. Summed into worker 0's staging, which the step consumes anyway.
  float* __restrict const mean = state.pushed[0]->data();
  const size_t size = state.pushed[0]->size();
  const uint32_t workers = layers_.workers();
  for (uint32_t w = 1; w < workers; ++w) {
    const float* __restrict const g = state.pushed[w]->data();
    for (size_t i = 0; i < size; ++i) mean[i] += g[i];
    staging_.RecycleLocked(state, *std::move(state.pushed[w]));
    state.pushed[w].reset();
  }
  // x / 1 is x, bit for bit: one worker's gradient is its own mean.
  if (workers > 1) {
    const float divisor = static_cast<float>(workers);
    for (size_t i = 0; i < size; ++i) mean[i] /= divisor;
  }
  if (layers_.spec().clip()) state.sum_of_squares = SumOfSquares(*state.pushed[0]);
  state.reduced = true;
}

absl::Status TrainerSteps::ApplyLocked(uint32_t layer, Layer& state,
                                       std::optional<float> clip_scale) {
  // All or nothing: every tensor's learning rate is checked before any
  // tensor steps, so a step either applies whole or leaves the layer as it
  // was, its pushes still staged.
  const uint64_t step = layers_.VersionLocked(state) + 1;  // 1-based, as torch counts
  std::vector<double> lrs;
  for (const TensorOptimizer& optimizer : state.optimizers) {
    const double lr = layers_.spec().LearningRate(optimizer.hyper(), step);
    if (!std::isfinite(lr) || lr < 0) {
      return absl::InternalError(absl::StrCat(
          "--optimizer ", layers_.spec().ToString(), " gives learning rate ", lr, " at step ", step,
          " for tensor ", layers_.store().model().layers[layer].tensors[lrs.size()].name,
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
  RETURN_IF_ERROR(
      master_.Step(layer, layers_.VersionLocked(state), [&](ChangeLog::Recording* recording) {
        uint64_t at = 0;
        for (uint32_t t = 0; t < optimizers.size(); ++t) {
          TensorOptimizer& optimizer = optimizers[t];
          const std::span<float> master(layers_.store().mutable_master(layer, t), optimizer.size());
          // Cannot fail: sizes match by construction and the lr was checked above.
          RETURN_IF_ERROR(optimizer.Step(lrs[t], master,
                                         std::span<const float>(mean.data() + at, optimizer.size()),
                                         recording != nullptr ? recording->ForTensor(t) : nullptr));
          at += optimizer.size();
          // A death with some tensors stepped: the restart takes the layer from
          // the checkpoint and the journal, never from this half.
          if (t == 0 && optimizers.size() > 1)
            FailPoint("step.mid_apply", layers_.store().shard_index());
        }
        return absl::OkStatus();
      }));
  staging_.RecycleLocked(state, *std::move(state.pushed[0]));
  state.pushed[0].reset();
  PushStaging::StepAppliedLocked(state);
  state.reduced = false;
  state.opened.reset();
  return absl::OkStatus();
}

}  // namespace layercast::server
