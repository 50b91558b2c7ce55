#pragma once

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

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
// Thread-safe.
class DeadlineTimers {
 public:
  using Handle = std::shared_ptr<boost::asio::steady_timer>;

  // On `shared`'s thread, which must outlive this; on a thread of its own
  // when null.
  explicit DeadlineTimers(DeadlineTimers* shared = nullptr);
  ~DeadlineTimers();
  DeadlineTimers(const DeadlineTimers&) = delete;
  DeadlineTimers& operator=(const DeadlineTimers&) = delete;

  // Runs `expired` on the timer thread at `at`, unless cancelled first.
  // Returns null (and never runs it) when `at` is time_point::max().
  Handle Schedule(std::chrono::steady_clock::time_point at, std::function<void()> expired);
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

  std::unique_ptr<Thread> own_;  // null on a shared thread
  boost::asio::io_context& io_;
  const std::shared_ptr<Scope> scope_ = std::make_shared<Scope>();
};

}  // namespace layercast::server
