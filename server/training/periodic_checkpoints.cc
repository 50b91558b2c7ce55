#include "server/training/periodic_checkpoints.h"

#include <chrono>

#include "platform/log.h"

namespace layercast::server {

PeriodicCheckpoints::PeriodicCheckpoints(VersionGate& gate, uint64_t every, Write write)
    : gate_(gate), every_(every), write_(std::move(write)), thread_([this] { Run(); }) {}

PeriodicCheckpoints::~PeriodicCheckpoints() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

bool PeriodicCheckpoints::AwaitVersion(uint64_t version) {
  {
    absl::MutexLock lock(&mu_);
    reached_ = false;
  }
  const uint64_t id = gate_.Wait(version, std::chrono::steady_clock::time_point::max(),
                                 [this](VersionGate::Outcome, uint64_t) {
                                   absl::MutexLock lock(&mu_);
                                   reached_ = true;  // or closed: the next check stops
                                 });
  bool reached = false;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](PeriodicCheckpoints* self)
             ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return self->reached_ || self->stopping_; },
        this));
    reached = reached_ && !stopping_;
  }
  if (!reached) {
    // Stopping: the callback must not run once this is gone, so it is
    // withdrawn, or waited for when already posted (bounded: an executor
    // stopped first would never run it).
    if (!gate_.Cancel(id)) {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&reached_), absl::Seconds(5));
    }
    return false;
  }
  return gate_.version() >= version;
}

void PeriodicCheckpoints::Run() {
  for (uint64_t version = gate_.version();;) {
    const uint64_t next = (version / every_ + 1) * every_;
    if (!AwaitVersion(next)) return;
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<CheckpointInfo> written = write_();
    if (written.ok()) {
      Log()->info("checkpoint version {} written to {} in {:.2f} s (--checkpoint-every {})",
                  written->version, written->path,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                  every_);
      version = written->version;
    } else {
      Log()->error(
          "the checkpoint at version {} (--checkpoint-every {}) failed: {}; the previous "
          "checkpoint and the push journal are kept, and the next multiple tries again",
          next, every_, written.status().message());
      version = next;
    }
  }
}

}  // namespace layercast::server
