#include "server/training/layer_trainer.h"

#include <chrono>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

// LayerTrainer's staging: a push admitted (BeginPush, EndPush), its step's
// staging reserved whole from the budget or the pool, and the buffers
// handed out and taken back.

namespace layercast::server {

uint64_t LayerTrainer::ReserveStep(uint32_t layer, uint64_t step,
                                   std::chrono::steady_clock::time_point give_up_at,
                                   ReservationReady ready) {
  LayerState& state = *layers_[layer];
  {
    absl::MutexLock lock(&state.mu);
    if (VersionLocked(state) == step && !state.reserved) {
      if ((state.budget_wait == 0 && ReserveFromPoolLocked(layer, state)) ||
          links_.budget == nullptr) {
        state.reserved = true;
      } else {
        const uint64_t id = next_wait_id_++;
        state.waiting.emplace(id, std::move(ready));
        if (state.budget_wait == 0) {
          // Posted, never run here: the lock is held.
          state.budget_wait = links_.budget->Acquire(
              StepBytes(layer), give_up_at,
              [this, layer](bool granted) { OnReservation(layer, granted); });
        }
        return id;
      }
    }
  }
  ready(true);
  return 0;
}

bool LayerTrainer::ReserveFromPoolLocked(uint32_t layer, LayerState& state) {
  // Never ahead of a request already waiting for budget: the pool's bytes
  // may be what it waits for (the reclaimer is about to drain the pool).
  if (links_.budget != nullptr && links_.budget->waiting() > 0) return false;
  std::vector<std::vector<float>> claimed = pool_->Claim(state.owned_elements, workers_);
  if (claimed.empty()) return false;
  const uint64_t rest = StepBytes(layer) - claimed.size() * StagingBytes(layer);
  // A reservation that has to wait holds nothing: the pooled buffers go
  // back (to the pool, or to whoever waits) and the budget is asked for the
  // whole step.
  if (rest > 0 && links_.budget != nullptr && !links_.budget->TryAcquire(rest)) {
    for (std::vector<float>& buffer : claimed) pool_->Give(std::move(buffer));
    return false;
  }
  state.spare = std::move(claimed);
  return true;
}

std::vector<float> LayerTrainer::TakeStaging(uint32_t layer) {
  LayerState& state = *layers_[layer];
  {
    absl::MutexLock lock(&state.mu);
    if (!state.spare.empty()) {
      std::vector<float> buffer = std::move(state.spare.back());
      state.spare.pop_back();
      return buffer;
    }
  }
  return std::vector<float>(state.owned_elements);
}

void LayerTrainer::RecycleLocked(LayerState& state, std::vector<float> buffer) {
  if (links_.budget != nullptr && !state.reserved) return;  // not charged: freed here
  pool_->Give(std::move(buffer));
}

void LayerTrainer::OnReservation(uint32_t layer, bool granted) {
  LayerState& state = *layers_[layer];
  std::map<uint64_t, ReservationReady> waiting;
  {
    absl::MutexLock lock(&state.mu);
    state.budget_wait = 0;
    state.reserved = granted;
    waiting.swap(state.waiting);
  }
  // Outside the lock: each push goes on to read its chunks.
  for (auto& [id, ready] : waiting) ready(granted);
}

bool LayerTrainer::CancelReservationWait(uint32_t layer, uint64_t id) {
  LayerState& state = *layers_[layer];
  absl::MutexLock lock(&state.mu);
  if (state.waiting.erase(id) == 0) return false;
  if (state.waiting.empty() && state.budget_wait != 0 && links_.budget->Cancel(state.budget_wait)) {
    state.budget_wait = 0;
  }
  return true;
}

absl::Status LayerTrainer::BeginPush(uint32_t layer, uint32_t worker, uint64_t step) {
  RETURN_IF_ERROR(CheckIndices(layer, worker));
  LayerState& state = *layers_[layer];
  absl::MutexLock lock(&state.mu);
  RETURN_IF_ERROR(CheckStepLocked(layer, worker, step, state));
  if (state.in_flight[worker] == step) {
    return absl::AbortedError(absl::StrCat(
        "worker ", worker, "'s push of layer ", layer, " for step ", step,
        " is already in flight on this shard; nothing of this one was staged. A push whose worker "
        "stopped sending is cut off after the shard's --write-progress-timeout-ms: retry then (if "
        "that worker is alive, two workers share index ",
        worker, ")"));
  }
  state.in_flight[worker] = step;
  return absl::OkStatus();
}

void LayerTrainer::EndPush(uint32_t layer, uint32_t worker, uint64_t step,
                           std::vector<float> unused) {
  LayerState& state = *layers_[layer];
  absl::MutexLock lock(&state.mu);
  if (state.in_flight[worker] == step) state.in_flight[worker] = kNoPush;
  // Still charged to the open step's reservation: its next push takes it
  // instead of allocating another.
  if (!unused.empty() && VersionLocked(state) == step && state.reserved) {
    state.spare.push_back(std::move(unused));
  }
}

LayerTrainer::OpenStep LayerTrainer::OldestOpenStep() const {
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

absl::StatusOr<LayerTrainer::PushTicket> LayerTrainer::AdmitPush(uint32_t layer, uint32_t worker,
                                                                 uint64_t step) {
  RETURN_IF_ERROR(BeginPush(layer, worker, step));
  PushTicket ticket(*this, layer, worker, step);  // ends the push if refused below
  const uint64_t step_bytes = StepBytes(layer);
  if (links_.budget != nullptr && !links_.budget->Grantable(step_bytes)) {
    const std::optional<uint64_t> budget = links_.budget->budget();
    return absl::ResourceExhaustedError(
        absl::StrCat("staging a step of layer ", layer, " takes ", FormatBytes(step_bytes),
                     " (every worker's push in fp32), more than the shard's budget of ",
                     budget ? FormatBytes(*budget) : "unlimited",
                     " leaves beside its master and optimizer state; raise --memory-budget"));
  }
  return ticket;
}

LayerTrainer::PushTicket::PushTicket(PushTicket&& other) noexcept
    : trainer_(std::exchange(other.trainer_, nullptr)),
      layer_(other.layer_),
      worker_(other.worker_),
      step_(other.step_),
      staging_(std::move(other.staging_)) {}

LayerTrainer::PushTicket::~PushTicket() {
  if (trainer_ != nullptr) trainer_->EndPush(layer_, worker_, step_, std::move(staging_));
}

uint64_t LayerTrainer::PushTicket::Reserve(std::chrono::steady_clock::time_point give_up_at,
                                           ReservationReady ready) {
  return trainer_->ReserveStep(layer_, step_, give_up_at, std::move(ready));
}

bool LayerTrainer::PushTicket::CancelWait(uint64_t id) {
  return trainer_->CancelReservationWait(layer_, id);
}

absl::StatusOr<std::span<float>> LayerTrainer::PushTicket::Stage() {
  try {
    staging_ = trainer_->TakeStaging(layer_);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("out of memory for ",
                                                     FormatBytes(trainer_->StagingBytes(layer_)),
                                                     " of gradient staging; retry later"));
  }
  return std::span<float>(staging_);
}

absl::StatusOr<LayerTrainer::Pushed> LayerTrainer::PushTicket::Push() {
  return trainer_->Push(layer_, worker_, step_, std::exchange(staging_, {}));
}

}  // namespace layercast::server
