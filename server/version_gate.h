#pragma once

#include <boost/asio/any_io_executor.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/deadline_timers.h"

namespace layercast::server {

// The shard's parameter version, and the streams waiting for it to reach a
// `min_version`. Reactors never block on it: they register a callback, which
// is always posted to `executor`, never run on the thread that calls Wait,
// Advance, Cancel or Close. So a reactor's constructor never starts
// writing, and a waiter's callback never runs inside another stream's code.
//
// Thread-safe.
class VersionGate {
 public:
  enum class Outcome {
    kReached,   // version() >= min_version
    kTimedOut,  // give_up_at came first
    kClosed,    // Close() came first: the shard is shutting down
  };
  // Gets the outcome and the version when it was decided.
  using Ready = std::function<void(Outcome outcome, uint64_t version)>;

  // `executor` runs every callback; it must outlive the gate's waiters.
  explicit VersionGate(boost::asio::any_io_executor executor, uint64_t version = 0);
  // Forgets waiters still registered (their callbacks never run).
  ~VersionGate();

  uint64_t version() const;

  // Raises the version to `version` (never lowers it) and posts every waiter
  // whose min_version is now reached.
  void Advance(uint64_t version);

  // Posts `ready` once version() >= min_version (at once if it already is),
  // at `give_up_at` (time_point::max(): never), or at Close(), whichever
  // comes first. Returns an id for Cancel.
  uint64_t Wait(uint64_t min_version, std::chrono::steady_clock::time_point give_up_at,
                Ready ready);

  // Forgets waiter `id`. True if it was still waiting (so `ready` will never
  // run); false if its callback has been posted.
  bool Cancel(uint64_t id);

  // Posts kClosed to every waiter, and to every later Wait not reached at
  // once. The drain calls it: parked streams end at once instead of holding
  // the shutdown.
  void Close();

  // Waiters registered and not yet posted or cancelled.
  size_t waiting() const;

 private:
  struct Waiter {
    uint64_t min_version;
    Ready ready;
    DeadlineTimers::Handle timer;  // null without a give-up time
  };
  // Removes waiter `it`, cancels its timer and posts its callback.
  void PostLocked(std::map<uint64_t, Waiter>::iterator it, Outcome outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Post(Ready ready, Outcome outcome, uint64_t version);

  const boost::asio::any_io_executor executor_;
  mutable absl::Mutex mu_;
  uint64_t version_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  DeadlineTimers timers_;  // last: see DeadlineTimers
};

}  // namespace layercast::server
