#include "server/training/trainer_clip.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "platform/status_macros.h"

namespace layercast::server {

TrainerClip::StepNorm TrainerClip::NormOfStep(uint64_t step) const {
  StepNorm norm;
  norm.max_norm = layers_.spec().clip().value_or(0);
  {
    absl::MutexLock lock(&layers_.all_mu());
    if (last_clip_ && last_clip_->first == step) norm.applied_scale = last_clip_->second;
  }
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const TrainerLayers::Layer& state = layers_.layer(l);
    absl::MutexLock lock(&state.mu);
    const uint64_t version = layers_.VersionLocked(state);
    if (version == step && state.reduced) {
      norm.sum_of_squares += state.sum_of_squares;
    } else if (version <= step) {
      norm.waiting_layers.push_back(l);
    }
  }
  norm.ready = norm.waiting_layers.empty();
  return norm;
}

absl::StatusOr<uint64_t> TrainerClip::ApplyClippedStep(uint64_t step, float scale) {
  if (!layers_.spec().clip()) {
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
  absl::MutexLock clip_lock(&layers_.all_mu());
  // A step applied (or begun) with a scale keeps it: a second call, such as
  // a restarted worker 0's with a scale it computed afresh, applies and
  // reports the first one, so no two layers or shards step with two.
  if (last_clip_ && last_clip_->first == step) scale = last_clip_->second;
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const TrainerLayers::Layer& state = layers_.layer(l);
    absl::MutexLock lock(&state.mu);
    const uint64_t version = layers_.VersionLocked(state);
    if (version == step + 1 || (version == step && state.reduced)) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", l, " is at version ", version, " and ",
        version == step ? "still waits for pushes" : "not at this step", ": a clipped step ", step,
        " applies once every layer has every worker's push"));
  }
  if (steps_.journal() != nullptr && !(last_clip_ && last_clip_->first == step)) {
    RETURN_IF_ERROR(steps_.journal()->AppendClipScale(step, scale));
  }
  // Before any layer applies: should one fail, a retry still learns the
  // scale the others used.
  last_clip_ = std::make_pair(step, scale);
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    TrainerLayers::Layer& state = layers_.layer(l);
    absl::MutexLock lock(&state.mu);
    if (layers_.VersionLocked(state) == step + 1) continue;  // applied by an earlier call
    RETURN_IF_ERROR(steps_.ApplyLocked(l, state, scale));
  }
  return step + 1;
}

std::optional<std::pair<uint64_t, float>> TrainerClip::last_clip() const {
  absl::MutexLock lock(&layers_.all_mu());
  return last_clip_;
}

void TrainerClip::set_last_clip(std::optional<std::pair<uint64_t, float>> clip) {
  absl::MutexLock lock(&layers_.all_mu());
  last_clip_ = clip;
}

}  // namespace layercast::server
