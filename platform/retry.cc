#include "platform/retry.h"

#include <algorithm>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace layercast::platform {
namespace {

// Counts a clock's jumps, so that a waiter sees one that came between its
// reading of the clock and its wait.
class JumpCounter final : public Clock::Listener {
 public:
  void Jumped() override {
    absl::MutexLock lock(&mu_);
    ++jumps_;
  }
  uint64_t jumps() {
    absl::MutexLock lock(&mu_);
    return jumps_;
  }
  // Waits for a jump after the `seen`th, or `timeout` of real time.
  void AwaitJumpAfter(uint64_t seen, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const auto jumped = [this, seen]()
                            ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return jumps_ != seen; };
    mu_.AwaitWithTimeout(absl::Condition(&jumped), timeout);
  }

 private:
  absl::Mutex mu_;
  uint64_t jumps_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

std::chrono::milliseconds Backoff::Next() {
  if (!rng_) rng_.emplace(std::random_device{}());
  const int64_t full =
      std::min<int64_t>(max_.count(), first_.count() << std::min<uint32_t>(waits_++, 20));
  return std::chrono::milliseconds(std::uniform_int_distribution<int64_t>(full / 2, full)(*rng_));
}

void SleepUntil(Clock& clock, Clock::TimePoint until) {
  JumpCounter counter;
  clock.Listen(&counter);
  for (;;) {
    const uint64_t seen = counter.jumps();
    const Clock::TimePoint now = clock.Now();
    if (now >= until) break;
    // The steady clock never jumps: the timeout is the wait. A ManualClock
    // stands still in real time: a jump wakes it, the timeout only looks again.
    counter.AwaitJumpAfter(seen, absl::FromChrono(until - now));
  }
  clock.Unlisten(&counter);
}

absl::Status Retry(const RetryPolicy& policy, Clock::TimePoint deadline,
                   absl::FunctionRef<absl::Status(int attempt)> attempt, const RetryHooks& hooks) {
  Backoff backoff(policy);
  for (int number = 1;; ++number) {
    absl::Status status = attempt(number);
    if (!policy.Retries(status) || number >= policy.max_attempts) return status;
    const std::chrono::milliseconds wait = backoff.Next();
    const Clock::TimePoint now = hooks.clock->Now();
    if (now + wait >= deadline) return status;
    if (hooks.on_retry) hooks.on_retry(status, number, wait);
    if (hooks.sleep) {
      if (!hooks.sleep(wait)) return status;
    } else {
      SleepUntil(*hooks.clock, now + wait);
    }
  }
}

}  // namespace layercast::platform
