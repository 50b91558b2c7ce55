#pragma once

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <thread>

namespace layercast::server {

// Runs callbacks at deadlines, and posted work, on one thread of its own
// (a Boost.Asio io_context). Declare it as the last member of its owner:
// it is destroyed first, and its destructor joins the thread, so no
// callback ever runs on a half-destroyed owner. Callbacks not yet run when
// it is destroyed never run.
//
// Thread-safe.
class DeadlineTimers {
 public:
  using Handle = std::shared_ptr<boost::asio::steady_timer>;

  DeadlineTimers();
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
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> keep_running_;
  std::thread thread_;
};

}  // namespace layercast::server
