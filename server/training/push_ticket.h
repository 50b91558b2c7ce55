#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "server/training/push_staging.h"
#include "server/training/trainer_layers.h"
#include "server/training/trainer_steps.h"

namespace layercast::server {

// One admitted push stream, from Admit until it goes: it holds its (step,
// worker, layer) in flight, asks for the step's staging, and stages the
// push and hands it to the step. Its destructor ends the push, keeping an
// untaken staging buffer for the step's next push. The only way through
// the push protocol of PushStaging and TrainerSteps. Not thread-safe, but
// for CancelWait (see its comment).
class PushTicket {
 public:
  using ReservationReady = TrainerLayers::ReservationReady;

  // The one call that admits a push stream of (layer, worker, step):
  //   NOT_FOUND            no such layer;
  //   INVALID_ARGUMENT     worker >= workers;
  //   FAILED_PRECONDITION  step is ahead of the layer's version (naming
  //                        both), or the trainer is frozen for a hand-over;
  //   ALREADY_EXISTS       this (step, worker, layer) was pushed already;
  //   ABORTED              another stream of it is in flight;
  //   RESOURCE_EXHAUSTED   the step's staging (StepBytes) could never fit
  //                        the budget beside the master and optimizer state.
  // Nothing is staged yet. `staging` and `steps` must outlive the ticket.
  static absl::StatusOr<PushTicket> Admit(PushStaging& staging, TrainerSteps& steps, uint32_t layer,
                                          uint32_t worker, uint64_t step);

  PushTicket(PushTicket&& other) noexcept;
  PushTicket& operator=(PushTicket&&) = delete;
  ~PushTicket();

  uint32_t layer() const { return layer_; }
  // Bytes of the whole step's staging this push waits for (W pushes).
  uint64_t StepBytes() const { return staging_->StepBytes(layer_); }
  // Reserves this push's step's staging (PushStaging::Reserve); `ready`
  // may run on this thread before it returns (the staging is reserved
  // already). Returns an id for CancelWait, 0 when `ready` ran.
  uint64_t Reserve(std::chrono::steady_clock::time_point give_up_at, ReservationReady ready);
  // True if wait `id` was still waiting (its `ready` will never run). May
  // be called from another thread while the push waits.
  bool CancelWait(uint64_t id);
  // The push's staging buffer, once Reserve's `ready(true)` ran;
  // RESOURCE_EXHAUSTED when memory runs out.
  absl::StatusOr<std::span<float>> Stage();
  // Hands the staged push to the step (TrainerSteps' push, journaled).
  absl::StatusOr<TrainerSteps::Pushed> Push();

 private:
  PushTicket(PushStaging& staging, TrainerSteps& steps, uint32_t layer, uint32_t worker,
             uint64_t step)
      : staging_(&staging), steps_(&steps), layer_(layer), worker_(worker), step_(step) {}

  PushStaging* staging_;  // null once moved from
  TrainerSteps* steps_;
  uint32_t layer_ = 0;
  uint32_t worker_ = 0;
  uint64_t step_ = 0;
  std::vector<float> staged_;
};

}  // namespace layercast::server
