#pragma once

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/optimizer_spec.h"
#include "server/serving/parameter_store.h"
#include "server/serving/version_gate.h"
#include "server/training/push_staging.h"
#include "server/training/push_ticket.h"
#include "server/training/trainer_checkpoint.h"
#include "server/training/trainer_clip.h"
#include "server/training/trainer_handover.h"
#include "server/training/trainer_layers.h"
#include "server/training/trainer_steps.h"

namespace layercast::server {

// One shard's training state: for every layer, its version (steps applied
// to it), the gradients pushed for its current step, one per data-parallel
// worker, and the optimizer state of the shard's slice of each tensor, in
// fp32. A layer's step is applied when all W workers' gradients for it are
// in, so the update of one layer overlaps the backward pass of the layers
// below it. Made of parts with one job each, which this holds together:
//
//   TrainerLayers      each layer's step state, and what it waits for
//   PushStaging        push admission and the step's staging reservation
//   PushTicket         one admitted push stream: the only way to push
//   TrainerSteps       the mean and the optimizer step, bit for bit torch's
//   TrainerClip        global-norm clipping across the layers of a step
//   TrainerCheckpoint  the state checkpoints hold, restore, journal replay
//   TrainerHandOver    the freeze and reads of a live hand-over
//
// Exactly once: a second push of the same (step, worker, layer) is
// ALREADY_EXISTS, whether its step is still open or already applied, so a
// worker retrying after an ambiguous failure changes nothing.
//
// Thread-safe; pushes to different layers proceed in parallel.
class LayerTrainer {
 public:
  using Links = TrainerLinks;
  using PushTicket = server::PushTicket;
  using Pushed = TrainerSteps::Pushed;
  using StepNorm = TrainerClip::StepNorm;
  using OpenStep = TrainerLayers::OpenStep;
  using Replayed = TrainerCheckpoint::Replayed;

  // `store` must outlive the trainer; its master is what the steps update.
  // INVALID_ARGUMENT for workers == 0; RESOURCE_EXHAUSTED when the
  // optimizer state cannot be allocated.
  static absl::StatusOr<std::unique_ptr<LayerTrainer>> Create(ParameterStore& store,
                                                              OptimizerSpec spec, uint32_t workers,
                                                              Links links = {});

  // Bytes of optimizer state held for the whole model on this shard
  // (AdamW: twice the master; SGD with momentum: once; plain SGD: none).
  static uint64_t StateBytes(const ParameterStore& store, const OptimizerSpec& spec);

  // What training adds to shard `shard_index` of `num_shards`'s memory,
  // known before its parameters load (the start-up check): the optimizer
  // state, and the staging of one step of its largest layer, one push per
  // worker. Saturates at UINT64_MAX rather than wrapping.
  struct Memory {
    uint64_t state_bytes = 0;
    uint64_t step_staging_bytes = 0;
  };
  // With clip=, every layer's mean is held until the scale arrives: one
  // more fp32 copy of the slice, counted in step_staging_bytes.
  static Memory MemoryFor(const ModelSpec& model, uint32_t shard_index, uint32_t num_shards,
                          const OptimizerSpec& spec, uint32_t workers);

  // Admits one push stream of (layer, worker, step): PushTicket::Admit.
  absl::StatusOr<PushTicket> AdmitPush(uint32_t layer, uint32_t worker, uint64_t step) {
    return PushTicket::Admit(staging_, steps_, layer, worker, step);
  }

  // Each layer's version, what its step waits for, the workers and spec.
  const TrainerLayers& layers() const { return layers_; }
  // The staging's sizes and its pool (for the budget's reclaimer).
  const PushStaging& staging() const { return staging_; }
  TrainerClip& clip() { return clip_; }
  TrainerCheckpoint& checkpoint() { return checkpoint_; }
  TrainerHandOver& hand_over() { return hand_over_; }

 private:
  // A gate for a trainer linked to none; its grants are never run (the
  // trainer waits on no version).
  struct OwnGate {
    boost::asio::io_context grants;
    VersionGate gate{grants.get_executor()};
  };

  LayerTrainer(ParameterStore& store, OptimizerSpec spec, uint32_t workers, Links links,
               uint64_t pool_bytes, std::unique_ptr<OwnGate> own_gate)
      : own_gate_(std::move(own_gate)),
        layers_(store, std::move(spec), workers, links),
        staging_(layers_, pool_bytes),
        steps_(layers_, staging_),
        clip_(layers_, steps_),
        checkpoint_(layers_, staging_, steps_, clip_),
        hand_over_(layers_) {}

  const std::unique_ptr<OwnGate> own_gate_;  // before layers_, whose links point at it
  TrainerLayers layers_;
  PushStaging staging_;
  TrainerSteps steps_;
  TrainerClip clip_;
  TrainerCheckpoint checkpoint_;
  TrainerHandOver hand_over_;
};

}  // namespace layercast::server
