#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "server/training/trainer_layers.h"
#include "server/training/trainer_steps.h"

namespace layercast::server {

// Global gradient-norm clipping (a spec with clip=). A layer whose W
// pushes are in is reduced to its mean, which is held (one fp32 value per
// owned element, the gradient accumulator) until ApplyClippedStep: every
// layer of a step must be reduced on every shard before the norm is known.
// Thread-safe.
class TrainerClip {
 public:
  // Each must outlive the clip.
  TrainerClip(TrainerLayers& layers, TrainerSteps& steps) : layers_(layers), steps_(steps) {}

  struct StepNorm {
    bool ready = false;                    // every layer of the step is reduced
    double sum_of_squares = 0;             // of this shard's mean gradient, fp64
    std::vector<uint32_t> waiting_layers;  // still missing pushes
    double max_norm = 0;                   // the spec's clip=, 0 without clipping
    std::optional<float> applied_scale;    // the step was applied with it
  };
  StepNorm NormOfStep(uint64_t step) const;
  // Multiplies every layer's held mean by `scale` (ClipScale of the global
  // norm) and steps its optimizer; returns the model's new version. A step
  // applied already answers the same. FAILED_PRECONDITION without clipping
  // or while a layer still waits for pushes; INVALID_ARGUMENT for a scale
  // outside [0, 1] (a NaN norm), changing nothing. Journaled (before any
  // layer applies) when the steps are.
  absl::StatusOr<uint64_t> ApplyClippedStep(uint64_t step, float scale);

  // The last clipped step applied (or begun) and its scale, which a
  // checkpoint keeps. REQUIRES: layers.all_mu() held (TrainerLayers::Paused).
  std::optional<std::pair<uint64_t, float>> last_clip_locked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(layers_.all_mu()) {
    return last_clip_;
  }
  std::optional<std::pair<uint64_t, float>> last_clip() const;
  // What a restored checkpoint says it was. Before any push.
  void set_last_clip(std::optional<std::pair<uint64_t, float>> clip);

 private:
  TrainerLayers& layers_;
  TrainerSteps& steps_;
  // The last clipped step applied and its scale; all_mu also serialises
  // clipped steps.
  std::optional<std::pair<uint64_t, float>> last_clip_ ABSL_GUARDED_BY(layers_.all_mu());
};

}  // namespace layercast::server
