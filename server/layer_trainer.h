#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/optimizer.h"
#include "core/optimizer_spec.h"
#include "server/parameter_store.h"

namespace layercast::server {

// One shard's training state: for every layer, its version (steps applied
// to it), the gradients pushed for its current step, one per data-parallel
// worker, and the optimizer state of the shard's slice of each tensor, in
// fp32. A layer's step is applied when all W workers' gradients for it are
// in, so the update of one layer overlaps the backward pass of the layers
// below it:
//
//   mean = (g_0 + g_1 + ... + g_{W-1}) / W
//
// summed left to right in worker order in fp32, then divided by W (true
// division, as torch's `sum.div_(W)`), whatever order the pushes arrived in:
// early arrivals wait, staged, for the workers before them. Then the
// optimizer (core/optimizer.h, bit for bit torch's) steps the fp32 master
// with the learning rate of step version + 1, and the version advances.
//
// Exactly once: a second push of the same (step, worker, layer) is
// ALREADY_EXISTS, whether its step is still open or already applied, so a
// worker retrying after an ambiguous failure changes nothing.
//
// Thread-safe; pushes to different layers proceed in parallel. Not yet
// wired to PushGradients (shards refuse it); the wiring must:
//   - keep readers of the master (FetchLayer streams) off a layer while
//     Push applies its step, and make this trainer's per-layer versions
//     the ones the VersionGate serves, so there is one source of truth;
//   - charge the staged pushes to the memory budget: up to W fp32 copies of
//     a layer's owned elements are held until its step applies (StateBytes
//     counts only the optimizer state).
class LayerTrainer {
 public:
  // `store` must outlive the trainer; its master is what the steps update.
  // INVALID_ARGUMENT for workers == 0; FAILED_PRECONDITION for a spec with
  // `clip`, which needs every shard's partial gradient norm before any
  // layer is updated (a step barrier across shards, not built yet);
  // RESOURCE_EXHAUSTED when the optimizer state cannot be allocated.
  static absl::StatusOr<std::unique_ptr<LayerTrainer>> Create(ParameterStore& store,
                                                              OptimizerSpec spec, uint32_t workers);

  // Bytes of optimizer state held for the whole model on this shard
  // (AdamW: twice the master; SGD with momentum: once; plain SGD: none).
  static uint64_t StateBytes(const ParameterStore& store, const OptimizerSpec& spec);

  struct Pushed {
    uint64_t layer_version;  // after this push
    bool applied;            // this push completed the layer's step
  };
  // Takes worker `worker`'s gradient of `layer` computed at version `step`:
  // the shard's owned elements of every tensor, back to back in tensor
  // order, widened to fp32 (as wire::GradientDecoder stages them).
  //   NOT_FOUND            no such layer;
  //   INVALID_ARGUMENT     worker >= workers, or the wrong number of values;
  //   FAILED_PRECONDITION  step is ahead of the layer's version (naming both);
  //   ALREADY_EXISTS       this (step, worker, layer) was pushed already.
  absl::StatusOr<Pushed> Push(uint32_t layer, uint32_t worker, uint64_t step,
                              std::vector<float> gradient);

  // REQUIRES for the three below: layer < the model's layers.
  // Elements of `layer` this shard owns: the size a push must have.
  uint64_t owned_elements(uint32_t layer) const { return layers_[layer]->owned_elements; }
  uint64_t version(uint32_t layer) const;
  // Workers whose push for `layer`'s current step has not arrived.
  uint32_t missing_workers(uint32_t layer) const;
  uint32_t workers() const { return workers_; }

 private:
  struct LayerState {
    mutable absl::Mutex mu;
    uint64_t owned_elements = 0;
    uint64_t version ABSL_GUARDED_BY(mu) = 0;
    // Per worker, its gradient for step `version`, until the step applies.
    std::vector<std::optional<std::vector<float>>> pushed ABSL_GUARDED_BY(mu);
    std::vector<TensorOptimizer> optimizers ABSL_GUARDED_BY(mu);  // per tensor
  };

  LayerTrainer(ParameterStore& store, OptimizerSpec spec, uint32_t workers)
      : store_(store), spec_(std::move(spec)), workers_(workers) {}

  // Averages the staged gradients and steps the optimizer on the master.
  absl::Status ApplyLocked(uint32_t layer, LayerState& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

  ParameterStore& store_;
  const OptimizerSpec spec_;
  const uint32_t workers_;
  std::vector<std::unique_ptr<LayerState>> layers_;
};

}  // namespace layercast::server
