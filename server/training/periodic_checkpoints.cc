#include "server/training/periodic_checkpoints.h"

#include <chrono>

#include "platform/log.h"

namespace layercast::server {

PeriodicCheckpoints::PeriodicCheckpoints(VersionGate& gate, uint64_t every, Write write,
                                         DeadlineTimers* background)
    : gate_(gate), every_(every), write_(std::move(write)), work_(background) {
  {
    absl::MutexLock lock(&link_->mu);
    link_->self = this;
  }
  Arm(gate_.version());
}

PeriodicCheckpoints::~PeriodicCheckpoints() {
  {
    absl::MutexLock lock(&link_->mu);
    link_->self = nullptr;
    gate_.Cancel(link_->wait);
  }
  // Then work_ goes first: it waits for a write under way and drops one
  // posted but not begun.
}

void PeriodicCheckpoints::Arm(uint64_t version) {
  const uint64_t next = (version / every_ + 1) * every_;
  // Under the link's lock, so that the destructor withdraws this wait or
  // finds none made after it.
  absl::MutexLock lock(&link_->mu);
  if (link_->self == nullptr) return;
  link_->wait =
      gate_.Wait(next, std::chrono::steady_clock::time_point::max(),
                 [link = link_, next](VersionGate::Outcome outcome, uint64_t) {
                   // Closed: the shard is draining, and no write starts.
                   if (outcome != VersionGate::Outcome::kReached) return;
                   absl::MutexLock lock(&link->mu);
                   if (link->self == nullptr) return;
                   link->self->work_.Post([self = link->self, next] { self->Reached(next); });
                 });
}

void PeriodicCheckpoints::Reached(uint64_t next) {
  // Real time, not work_'s clock: a log's durations are what the write took,
  // also under a test's ManualClock, which stands still meanwhile.
  const auto start = std::chrono::steady_clock::now();
  writing_.store(true);
  absl::StatusOr<CheckpointInfo> written = write_();
  writing_.store(false);
  if (written.ok()) {
    Log()->info("checkpoint version {} written to {} in {:.2f} s (--checkpoint-every {})",
                written->version, written->path,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                every_);
    Arm(written->version);
    return;
  }
  Log()->error(
      "the checkpoint at version {} (--checkpoint-every {}) failed: {}; the previous "
      "checkpoint and the push journal are kept, and the next multiple tries again",
      next, every_, written.status().message());
  Arm(next);
}

}  // namespace layercast::server
