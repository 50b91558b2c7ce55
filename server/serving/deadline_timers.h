#pragma once

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "platform/clock.h"

namespace layercast::server {

// Runs callbacks at deadlines, and posted work, on one thread (a Boost.Asio
// io_context): a thread of its own, or the shard's timer thread, that of
// the DeadlineTimers it was given. Declare it as the last member of its
// owner: it is destroyed first, and its destructor waits for a callback of
// its owner under way and stops the rest (on a thread of its own, it joins
// the thread), so no callback ever runs on a half-destroyed owner.
// Callbacks not yet run when it is destroyed never run.
//
// On a shared thread every owner's callbacks wait for each other's: a
// callback must not block (take a lock only held briefly, post anything
// long). REQUIRES: it is not destroyed from one of its own callbacks (the
// destructor would wait for the callback that runs it; it aborts instead).
//
// Deadlines are read on a platform::Clock: the steady clock, or a test's
// ManualClock, on which a callback runs when the clock is moved past its
// deadline, never by itself; ManualClock::Advance returns once every
// callback it passed ran, in deadline order across the owners of the
// thread. Owners read the time their deadlines mean from Now().
//
// Thread-safe.
class DeadlineTimers final : private platform::Clock::Listener {
 public:
  struct Timer;
  using Handle = std::shared_ptr<Timer>;

  // On `shared`'s thread and clock, which must outlive this; on a thread of
  // its own and the steady clock when null.
  explicit DeadlineTimers(DeadlineTimers* shared = nullptr);
  // On a thread of its own, reading `clock`, which must outlive this.
  explicit DeadlineTimers(platform::Clock& clock);
  ~DeadlineTimers();
  DeadlineTimers(const DeadlineTimers&) = delete;
  DeadlineTimers& operator=(const DeadlineTimers&) = delete;

  // The time on this one's clock; deadlines given to Schedule are on it.
  platform::Clock::TimePoint Now() const { return clock_.Now(); }
  platform::Clock& clock() const { return clock_; }

  // Runs `expired` on the timer thread at `at`, unless cancelled first.
  // Returns null (and never runs it) when `at` is time_point::max().
  Handle Schedule(platform::Clock::TimePoint at, std::function<void()> expired);
  // Stops `timer` from running (a no-op for null, or one that already ran).
  // Callers must still tolerate a callback that was already under way.
  void Cancel(const Handle& timer);
  // Runs `work` on the timer thread soon.
  void Post(std::function<void()> work);

 private:
  // The thread and its io_context, for DeadlineTimers that own one.
  struct Thread {
    boost::asio::io_context io;
    boost::asio::executor_work_guard<boost::asio::io_context::executor_type> keep_running{
        boost::asio::make_work_guard(io)};
    std::thread thread{[this] { io.run(); }};
  };
  // Whether this one's callbacks may still run; a callback runs holding mu.
  struct Scope {
    absl::Mutex mu;
    bool alive ABSL_GUARDED_BY(mu) = true;
    // The thread running one of its callbacks now, for the destructor's
    // check; empty otherwise.
    std::atomic<std::thread::id> running{};
  };
  // `work` as it runs on the timer thread: only while this one is alive.
  std::function<void()> Scoped(std::function<void()> work) const;
  // On a jumping clock, the timers of every owner of one thread not yet
  // run, by deadline; Asio never waits for them. Shared by the owners.
  struct Pending {
    explicit Pending(platform::Clock& clock) : clock(clock) {}
    // On the timer thread: runs the timers due by the clock, in deadline
    // order whoever owns them, until none is due.
    void RunDue();
    platform::Clock& clock;
    absl::Mutex mu;
    std::multimap<platform::Clock::TimePoint, Handle> timers ABSL_GUARDED_BY(mu);
  };
  // The thread's owner, on a jumping clock: runs what is due on the timer
  // thread and returns once it ran.
  void Jumped() override;

  std::unique_ptr<Thread> own_;  // null on a shared thread
  boost::asio::io_context& io_;
  platform::Clock& clock_;
  const bool steady_;  // clock_ is the steady clock: Asio's timers wait
  const std::shared_ptr<Scope> scope_ = std::make_shared<Scope>();
  const std::shared_ptr<Pending> pending_;  // null on the steady clock
};

}  // namespace layercast::server
