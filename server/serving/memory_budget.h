#pragma once

#include <boost/asio/any_io_executor.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/serving/deadline_timers.h"

namespace layercast::server {

// The server's memory budget: the fp32 master is charged once at start; the
// chunk buffers of streams in flight are drawn from what remains. A request
// that does not fit waits in arrival order (first come, first served: a large
// request is never starved by smaller ones behind it) and is granted by the
// Release() that makes room, or refused when its deadline comes. Nothing is
// ever granted beyond the budget.
//
// Reactors must not block, so Acquire() never waits on the caller's thread,
// and no call ever runs a requester's callback on the caller's thread either:
// every grant and refusal is posted to `grants` (the shard's grant executor),
// so Release() and Cancel() never run other streams' code inline, and a
// reactor that calls Acquire() is never re-entered before it returns.
// Deadlines run on the budget's own timer thread.
//
// Thread-safe.
class MemoryBudget {
 public:
  // Called with the lock held after every change: must be cheap and must not
  // call back into the budget (it feeds metrics gauges).
  using Observer = std::function<void(uint64_t in_use, size_t waiting)>;
  // Runs once: true when the bytes are granted, false when the deadline came
  // first.
  using Granted = std::function<void(bool granted)>;

  // `budget_bytes` nullopt: unlimited (everything is still counted).
  // `grants` runs every Granted callback and must outlive pending ones.
  // REQUIRES: master_bytes <= *budget_bytes (checked at start-up).
  // `timers`: the shard's timer thread (must outlive this); null: a thread
  // of its own.
  MemoryBudget(std::optional<uint64_t> budget_bytes, uint64_t master_bytes,
               boost::asio::any_io_executor grants, Observer observer = {},
               DeadlineTimers* timers = nullptr);
  // Forgets requests still waiting (their callbacks never run).
  ~MemoryBudget();

  // Posts `granted(true)` once `bytes` are reserved: at once when they fit
  // and nobody waits ahead, else when a Release() makes room; or
  // `granted(false)` at `give_up_at`. Returns an id for Cancel. A request
  // that can never fit would wait until then: callers check Grantable()
  // first.
  uint64_t Acquire(uint64_t bytes, std::chrono::steady_clock::time_point give_up_at,
                   Granted granted);

  // Reserves `bytes` only if they fit now and nobody waits ahead: for
  // memory that is nice to have (SharedChunks), which must never jump the
  // queue of streams that need it.
  bool TryAcquire(uint64_t bytes);

  // Counts `bytes` held whatever the budget says (a relay's held versions,
  // which its upstream sends): requests wait for room beside them, and
  // Release() gives them back.
  void Charge(uint64_t bytes);

  // `reclaim` runs on the budget's timer thread whenever a request has to
  // wait: it should Release() whatever can be given up.
  void SetReclaimer(std::function<void()> reclaim);

  // Withdraws waiting request `id`. True if it was still waiting (`granted`
  // will never run); false if its callback has been posted.
  bool Cancel(uint64_t id);

  // Returns `bytes` granted earlier and grants waiting requests in order.
  void Release(uint64_t bytes);

  // Whether a request of `bytes` fits beside the master when nothing else is
  // in use.
  bool Grantable(uint64_t bytes) const;

  uint64_t in_use() const;  // master + granted bytes
  uint64_t peak() const;    // highest in_use() so far
  size_t waiting() const;   // requests queued
  std::optional<uint64_t> budget() const { return budget_; }

 private:
  struct Waiter {
    uint64_t id;
    uint64_t bytes;
    Granted granted;
    DeadlineTimers::Handle timer;
  };

  bool FitsLocked(uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes waiter `id` and grants what removing it lets through. False if
  // there is no such waiter.
  bool RemoveLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Grants queued requests in order while the head fits.
  void GrantWaitersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Post(Granted granted, bool ok);
  void Expire(uint64_t id);

  const std::optional<uint64_t> budget_;
  const uint64_t master_bytes_;
  const boost::asio::any_io_executor grants_;
  const Observer observer_;

  mutable absl::Mutex mu_;
  uint64_t in_use_ ABSL_GUARDED_BY(mu_);
  uint64_t peak_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  std::function<void()> reclaim_ ABSL_GUARDED_BY(mu_);
  DeadlineTimers timers_;  // last: see DeadlineTimers
};

}  // namespace layercast::server
