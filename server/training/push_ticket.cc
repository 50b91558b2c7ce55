#include "server/training/push_ticket.h"

#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::server {

absl::StatusOr<PushTicket> PushTicket::Admit(PushStaging& staging, TrainerSteps& steps,
                                             uint32_t layer, uint32_t worker, uint64_t step) {
  RETURN_IF_ERROR(staging.Begin(layer, worker, step));
  return PushTicket(staging, steps, layer, worker, step);
}

PushTicket::PushTicket(PushTicket&& other) noexcept
    : staging_(std::exchange(other.staging_, nullptr)),
      steps_(other.steps_),
      layer_(other.layer_),
      worker_(other.worker_),
      step_(other.step_),
      staged_(std::move(other.staged_)) {}

PushTicket::~PushTicket() {
  if (staging_ != nullptr) staging_->End(layer_, worker_, step_, std::move(staged_));
}

uint64_t PushTicket::Reserve(std::chrono::steady_clock::time_point give_up_at,
                             ReservationReady ready) {
  return staging_->Reserve(layer_, step_, give_up_at, std::move(ready));
}

bool PushTicket::CancelWait(uint64_t id) { return staging_->CancelWait(layer_, id); }

absl::StatusOr<std::span<float>> PushTicket::Stage() {
  try {
    staged_ = staging_->Take(layer_);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("out of memory for ",
                                                     FormatBytes(staging_->StagingBytes(layer_)),
                                                     " of gradient staging; retry later"));
  }
  return std::span<float>(staged_);
}

absl::StatusOr<TrainerSteps::Pushed> PushTicket::Push() {
  return steps_->Push(layer_, worker_, step_, std::exchange(staged_, {}));
}

}  // namespace layercast::server
