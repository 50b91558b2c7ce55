#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "server/training/push_journal.h"
#include "server/training/push_staging.h"
#include "server/training/trainer_layers.h"
#include "server/versions/versioned_master.h"

namespace layercast::server {

// The step math of each layer: the gradients pushed for its current step,
// one per data-parallel worker, reduced to their mean when all W are in,
// and the optimizer stepping the fp32 master with it:
//
//   mean = (g_0 + g_1 + ... + g_{W-1}) / W
//
// summed left to right in worker order in fp32, then divided by W (true
// division, as torch's `sum.div_(W)`), whatever order the pushes arrived in:
// early arrivals wait, staged, for the workers before them. Then the
// optimizer (core/optimizer.h, bit for bit torch's) steps the fp32 master
// with the learning rate of step version + 1, and the version advances.
//
// A step holds the layer's ParameterStore::layer_mutex exclusively while
// it changes the master and advances the layer in the VersionGate, so a
// reader holding it shared sees the master and the version agree.
//
// Thread-safe; pushes to different layers proceed in parallel.
class TrainerSteps {
 public:
  struct Pushed {
    uint64_t layer_version = 0;    // after this push
    bool applied = false;          // this push completed the layer's step
    double optimizer_seconds = 0;  // the step's, when applied
    double step_seconds = 0;       // since the step's first push, when applied
  };

  // Each must outlive the steps.
  TrainerSteps(TrainerLayers& layers, PushStaging& staging)
      : layers_(layers),
        staging_(staging),
        master_({.store = &layers.store(),
                 .gate = layers.links().gate,
                 .changes = layers.links().changes,
                 .pinned = layers.links().pinned}) {}

  // From now on every push (and, through TrainerClip, clip scale) is
  // appended to `journal` before it is taken. Before any push; `journal`
  // must outlive the steps.
  void JournalTo(PushJournal& journal) { journal_ = &journal; }
  PushJournal* journal() const { return journal_; }

  // Push's part once the step is checked (and journaled): stages
  // `gradient`, and reduces (clipping) or applies the step when it was the
  // last push. A journal replay takes its pushes here.
  absl::StatusOr<Pushed> TakeLocked(uint32_t layer, uint32_t worker, TrainerLayers::Layer& state,
                                    std::vector<float> gradient)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // Reduces (if not yet), scales the mean by `clip_scale` if given, and
  // steps the optimizer on the master. All or nothing: a learning rate that
  // is not finite leaves the layer as it was, its pushes still staged.
  absl::Status ApplyLocked(uint32_t layer, TrainerLayers::Layer& state,
                           std::optional<float> clip_scale) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // The mean's sum of squares in fp64, in element order (clipping's norm).
  static double SumOfSquares(const std::vector<float>& mean);

 private:
  friend class PushTicket;

  // Takes worker `worker`'s gradient of `layer` computed at version `step`:
  // the shard's owned elements of every tensor, back to back in tensor
  // order, widened to fp32 (as wire::GradientDecoder stages them). Appends
  // it to the journal first.
  //   NOT_FOUND            no such layer;
  //   INVALID_ARGUMENT     worker >= workers, or the wrong number of values;
  //   FAILED_PRECONDITION  step is ahead of the layer's version (naming both);
  //   ALREADY_EXISTS       this (step, worker, layer) was pushed already.
  // What a PushTicket hands over; every push comes through one.
  absl::StatusOr<Pushed> Push(uint32_t layer, uint32_t worker, uint64_t step,
                              std::vector<float> gradient);

  // Averages the staged gradients into pushed[0], in worker order, and
  // recycles the other workers' staging.
  void ReduceLocked(TrainerLayers::Layer& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

  TrainerLayers& layers_;
  PushStaging& staging_;
  VersionedMaster master_;          // how a step changes each layer
  PushJournal* journal_ = nullptr;  // set before any push
};

}  // namespace layercast::server
