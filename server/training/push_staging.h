#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/training/staging_pool.h"
#include "server/training/trainer_layers.h"

namespace layercast::server {

class PushTicket;

// The staging of pushes: each push stream admitted once (one stream per
// (step, worker, layer) in flight), and its step's staging (one float per
// owned element for each of the W pushes) reserved from the budget whole,
// once, for the step: every push of the step waits for that one
// reservation, so a step that has begun can always complete, however many
// pushes of other steps wait for budget. The step returns it as it applies
// (with clipping, the mean's share when the scale arrives) to a
// StagingPool, which keeps the buffers, still charged, for the next step of
// a layer of that size (spare_staging(): drained when the budget needs
// room).
//
// The push protocol (admit, reserve, stage, end) is private: a PushTicket
// is the only way through it. Thread-safe.
class PushStaging {
 public:
  // The pool keeps up to `pool_bytes` of staging for later steps.
  PushStaging(TrainerLayers& layers, uint64_t pool_bytes)
      : layers_(layers), pool_(std::make_shared<StagingPool>(pool_bytes, layers.links().budget)) {}

  // REQUIRES for the two below: layer < the model's layers.
  // Bytes of one staged push of `layer`, and of a whole step's (W pushes).
  uint64_t StagingBytes(uint32_t layer) const {
    return layers_.owned_elements(layer) * sizeof(float);
  }
  uint64_t StepBytes(uint32_t layer) const { return layers_.workers() * StagingBytes(layer); }
  // The pooled staging of applied steps, for the budget's reclaimer to
  // drain (held weakly: the reclaimer may outlive the trainer).
  std::weak_ptr<StagingPool> spare_staging() const { return pool_; }

  // For the step: a staging buffer charged to the step's reservation goes
  // to the pool with its charge; one that is not (no reservation: unit
  // tests) is freed.
  void RecycleLocked(TrainerLayers::Layer& state, std::vector<float> buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // The step applied: its reservation is spent (what it still held as
  // spare buffers is freed, its charge having gone with the W recycled).
  static void StepAppliedLocked(TrainerLayers::Layer& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // Charges the open step's staging to the budget if nothing has yet
  // (restored or replayed pushes, which no reservation brought);
  // RESOURCE_EXHAUSTED, naming `what` holds them, when it does not fit.
  absl::Status ChargeRestoredLocked(uint32_t layer, TrainerLayers::Layer& state, uint64_t bytes,
                                    absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

 private:
  friend class PushTicket;

  // Admits one push stream of (layer, worker, step) before anything is
  // staged: the error the step would return now, ABORTED while another
  // stream of the same (step, worker, layer) is in flight (a second would
  // stage the layer slice again, outside the step's reservation), or
  // RESOURCE_EXHAUSTED when the step's staging (StepBytes) could never fit
  // the budget beside the master and optimizer state. OK marks it in
  // flight until End. REQUIRES for an OK answer: End follows.
  absl::Status Begin(uint32_t layer, uint32_t worker, uint64_t step);
  // The stream Begin admitted has ended, taken by the step or not;
  // `unused` is its staging if the step did not take it (empty
  // otherwise), kept for the step's next push while the step's reservation
  // holds it.
  void End(uint32_t layer, uint32_t worker, uint64_t step, std::vector<float> unused);
  // Calls `ready(true)` once `step` of `layer` has its staging reserved:
  // inline, on this thread, when it has already (or `step` is not the
  // layer's current step: the push will be refused), and returns 0; else
  // the first caller asks the budget for StepBytes and every caller of the
  // step waits for that one grant, which calls each `ready` on the budget's
  // grant executor, or `ready(false)` at the first caller's `give_up_at`.
  // Returns an id for CancelWait. REQUIRES: layer < layers.
  uint64_t Reserve(uint32_t layer, uint64_t step, std::chrono::steady_clock::time_point give_up_at,
                   TrainerLayers::ReservationReady ready);
  // Withdraws wait `id`: true if it was still waiting (its `ready` will never
  // run); the last waiter withdrawn withdraws the budget request too.
  bool CancelWait(uint32_t layer, uint64_t id);
  // A buffer for one push of `layer`'s current step: one the step's
  // reservation claimed from the pool, else a new one. Contents
  // unspecified. Throws std::bad_alloc when memory runs out.
  std::vector<float> Take(uint32_t layer);

  // Reserves `layer`'s current step from pooled buffers of its size, topped
  // up from the budget if it has the rest free now; false (taking nothing)
  // otherwise, or while a request waits for budget.
  bool ReserveFromPoolLocked(uint32_t layer, TrainerLayers::Layer& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // The budget's answer to layer `layer`'s reservation request.
  void OnReservation(uint32_t layer, bool granted);

  TrainerLayers& layers_;
  const std::shared_ptr<StagingPool> pool_;
  std::atomic<uint64_t> next_wait_id_{1};
};

}  // namespace layercast::server
