#include "server/training/push_staging.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::server {

using Layer = TrainerLayers::Layer;

absl::Status PushStaging::Begin(uint32_t layer, uint32_t worker, uint64_t step) {
  RETURN_IF_ERROR(layers_.CheckIndices(layer, worker));
  {
    Layer& state = layers_.layer(layer);
    absl::MutexLock lock(&state.mu);
    RETURN_IF_ERROR(layers_.CheckStepLocked(layer, worker, step, state));
    if (state.in_flight[worker] == step) {
      return absl::AbortedError(absl::StrCat(
          "worker ", worker, "'s push of layer ", layer, " for step ", step,
          " is already in flight on this shard; nothing of this one was staged. A push whose "
          "worker stopped sending is cut off after the shard's --write-progress-timeout-ms: retry "
          "then (if that worker is alive, two workers share index ",
          worker, ")"));
    }
    state.in_flight[worker] = step;
  }
  MemoryBudget* const budget = layers_.links().budget;
  const uint64_t step_bytes = StepBytes(layer);
  if (budget != nullptr && !budget->Grantable(step_bytes)) {
    End(layer, worker, step, {});
    const std::optional<uint64_t> limit = budget->budget();
    return absl::ResourceExhaustedError(
        absl::StrCat("staging a step of layer ", layer, " takes ", FormatBytes(step_bytes),
                     " (every worker's push in fp32), more than the shard's budget of ",
                     limit ? FormatBytes(*limit) : "unlimited",
                     " leaves beside its master and optimizer state; raise --memory-budget"));
  }
  return absl::OkStatus();
}

void PushStaging::End(uint32_t layer, uint32_t worker, uint64_t step, std::vector<float> unused) {
  Layer& state = layers_.layer(layer);
  absl::MutexLock lock(&state.mu);
  if (state.in_flight[worker] == step) state.in_flight[worker] = TrainerLayers::kNoPush;
  // Still charged to the open step's reservation: its next push takes it
  // instead of allocating another.
  if (!unused.empty() && layers_.VersionLocked(state) == step && state.reserved) {
    state.spare.push_back(std::move(unused));
  }
}

uint64_t PushStaging::Reserve(uint32_t layer, uint64_t step,
                              std::chrono::steady_clock::time_point give_up_at,
                              TrainerLayers::ReservationReady ready) {
  Layer& state = layers_.layer(layer);
  MemoryBudget* const budget = layers_.links().budget;
  {
    absl::MutexLock lock(&state.mu);
    if (layers_.VersionLocked(state) == step && !state.reserved) {
      if ((state.budget_wait == 0 && ReserveFromPoolLocked(layer, state)) || budget == nullptr) {
        state.reserved = true;
      } else {
        const uint64_t id = next_wait_id_++;
        state.waiting.emplace(id, std::move(ready));
        if (state.budget_wait == 0) {
          // Posted, never run here: the lock is held.
          state.budget_wait =
              budget->Acquire(StepBytes(layer), give_up_at,
                              [this, layer](bool granted) { OnReservation(layer, granted); });
        }
        return id;
      }
    }
  }
  ready(true);
  return 0;
}

bool PushStaging::ReserveFromPoolLocked(uint32_t layer, Layer& state) {
  MemoryBudget* const budget = layers_.links().budget;
  // Never ahead of a request already waiting for budget: the pool's bytes
  // may be what it waits for (the reclaimer is about to drain the pool).
  if (budget != nullptr && budget->waiting() > 0) return false;
  std::vector<std::vector<float>> claimed = pool_->Claim(state.owned_elements, layers_.workers());
  if (claimed.empty()) return false;
  const uint64_t rest = StepBytes(layer) - claimed.size() * StagingBytes(layer);
  // A reservation that has to wait holds nothing: the pooled buffers go
  // back (to the pool, or to whoever waits) and the budget is asked for the
  // whole step.
  if (rest > 0 && budget != nullptr && !budget->TryAcquire(rest)) {
    for (std::vector<float>& buffer : claimed) pool_->Give(std::move(buffer));
    return false;
  }
  state.spare = std::move(claimed);
  return true;
}

std::vector<float> PushStaging::Take(uint32_t layer) {
  Layer& state = layers_.layer(layer);
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

void PushStaging::RecycleLocked(Layer& state, std::vector<float> buffer) {
  if (layers_.links().budget != nullptr && !state.reserved) return;  // not charged: freed here
  pool_->Give(std::move(buffer));
}

void PushStaging::StepAppliedLocked(Layer& state) {
  // What the step's pushes left untaken: the step's charge went with the W
  // buffers recycled.
  state.spare.clear();
  state.reserved = false;
}

void PushStaging::OnReservation(uint32_t layer, bool granted) {
  Layer& state = layers_.layer(layer);
  std::map<uint64_t, TrainerLayers::ReservationReady> waiting;
  {
    absl::MutexLock lock(&state.mu);
    state.budget_wait = 0;
    state.reserved = granted;
    waiting.swap(state.waiting);
  }
  // Outside the lock: each push goes on to read its chunks.
  for (auto& [id, ready] : waiting) ready(granted);
}

bool PushStaging::CancelWait(uint32_t layer, uint64_t id) {
  Layer& state = layers_.layer(layer);
  absl::MutexLock lock(&state.mu);
  if (state.waiting.erase(id) == 0) return false;
  if (state.waiting.empty() && state.budget_wait != 0 &&
      layers_.links().budget->Cancel(state.budget_wait)) {
    state.budget_wait = 0;
  }
  return true;
}

absl::Status PushStaging::ChargeRestoredLocked(uint32_t layer, Layer& state, uint64_t bytes,
                                               absl::string_view what) {
  if (state.reserved) return absl::OkStatus();
  MemoryBudget* const budget = layers_.links().budget;
  if (budget != nullptr && !budget->TryAcquire(bytes)) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " holds pushes of an open step of layer ", layer, ", whose staging (",
                     FormatBytes(bytes),
                     ") no longer fits --memory-budget beside what is loaded: raise "
                     "--memory-budget"));
  }
  state.reserved = true;
  state.opened = std::chrono::steady_clock::now();
  return absl::OkStatus();
}

}  // namespace layercast::server
