#pragma once

#include <chrono>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace layercast::platform {

// The time a shard's timers and windows read (deadlines, retentions, stall
// sweeps, publish timeouts): the steady clock in every program, a clock the
// test moves in tests, so that a window is an event a test causes instead of
// a sleep it hopes is long enough on a loaded machine.
//
// Hand-written rather than Boost.Asio's waitable timers over a custom clock
// type: Asio's clock is a type whose now() is static, one per process, and a
// test runs several shards, each with its own time.
class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  // Told after each jump of a clock that jumps (ManualClock), so that
  // timers waiting on it look again; the steady clock never jumps.
  class Listener {
   public:
    virtual void Jumped() = 0;

   protected:
    ~Listener() = default;
  };

  virtual ~Clock() = default;
  virtual TimePoint Now() const = 0;
  // `listener` must stay valid until Unlisten, which waits for a Jumped
  // under way.
  virtual void Listen(Listener* listener) = 0;
  virtual void Unlisten(Listener* listener) = 0;

  // The process's steady clock: flows by itself, never jumps.
  static Clock& Steady();
};

// A clock that stands still until told to move (tests). Thread-safe.
class ManualClock final : public Clock {
 public:
  // Starts at the steady clock's now, so that deadlines computed from
  // either clock in one test stay comparable.
  ManualClock();

  TimePoint Now() const override;
  void Listen(Listener* listener) override;
  void Unlisten(Listener* listener) override;

  // Moves the clock by `by` (>= 0) and returns once every listener looked
  // again: a DeadlineTimers on it has run every callback now due. Must not
  // be called from such a callback.
  void Advance(std::chrono::steady_clock::duration by);

 private:
  mutable absl::Mutex now_mu_;
  TimePoint now_ ABSL_GUARDED_BY(now_mu_);
  // Held while listeners are told, so that Unlisten waits for them.
  absl::Mutex listeners_mu_;
  std::vector<Listener*> listeners_ ABSL_GUARDED_BY(listeners_mu_);
};

}  // namespace layercast::platform
