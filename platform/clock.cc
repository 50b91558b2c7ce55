#include "platform/clock.h"

#include <algorithm>

namespace layercast::platform {
namespace {

class SteadyClock final : public Clock {
 public:
  TimePoint Now() const override { return std::chrono::steady_clock::now(); }
  void Listen(Listener*) override {}
  void Unlisten(Listener*) override {}
};

}  // namespace

Clock& Clock::Steady() {
  static SteadyClock* const steady = new SteadyClock;  // never destroyed: used at exit
  return *steady;
}

ManualClock::ManualClock() : now_(std::chrono::steady_clock::now()) {}

Clock::TimePoint ManualClock::Now() const {
  absl::MutexLock lock(&now_mu_);
  return now_;
}

void ManualClock::Listen(Listener* listener) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.push_back(listener);
}

void ManualClock::Unlisten(Listener* listener) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.erase(std::remove(listeners_.begin(), listeners_.end(), listener), listeners_.end());
}

void ManualClock::Advance(std::chrono::steady_clock::duration by) {
  {
    absl::MutexLock lock(&now_mu_);
    now_ += std::max(by, std::chrono::steady_clock::duration::zero());
  }
  absl::MutexLock lock(&listeners_mu_);
  for (Listener* listener : listeners_) listener->Jumped();
}

}  // namespace layercast::platform
