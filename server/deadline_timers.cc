#include "server/deadline_timers.h"

#include <boost/asio/post.hpp>
#include <cstdlib>

#include "platform/log.h"

namespace layercast::server {

DeadlineTimers::DeadlineTimers(DeadlineTimers* shared)
    : own_(shared == nullptr ? std::make_unique<Thread>() : nullptr),
      io_(shared == nullptr ? own_->io : shared->io_) {}

DeadlineTimers::~DeadlineTimers() {
  if (scope_->running.load() == std::this_thread::get_id()) {
    Log()->critical(
        "DeadlineTimers destroyed from one of its own callbacks: it would wait for "
        "itself");
    std::abort();
  }
  {
    // Waits for a callback under way; none runs after.
    absl::MutexLock lock(&scope_->mu);
    scope_->alive = false;
  }
  if (own_ != nullptr) {
    own_->keep_running.reset();
    own_->io.stop();
    own_->thread.join();
  }
}

std::function<void()> DeadlineTimers::Scoped(std::function<void()> work) const {
  return [scope = scope_, work = std::move(work)] {
    absl::MutexLock lock(&scope->mu);
    if (!scope->alive) return;
    scope->running = std::this_thread::get_id();
    work();
    scope->running = std::thread::id();
  };
}

DeadlineTimers::Handle DeadlineTimers::Schedule(std::chrono::steady_clock::time_point at,
                                                std::function<void()> expired) {
  if (at == std::chrono::steady_clock::time_point::max()) return nullptr;
  auto timer = std::make_shared<boost::asio::steady_timer>(io_, at);
  // The handler holds the timer while it waits, so a Handle dropped by its
  // owner leaves it to run or be cancelled.
  timer->async_wait(
      [timer, expired = Scoped(std::move(expired))](const boost::system::error_code& error) {
        if (!error) expired();
      });
  return timer;
}

void DeadlineTimers::Cancel(const Handle& timer) {
  // A timer belongs to the timer thread; it is cancelled there.
  if (timer) boost::asio::post(io_, [timer] { timer->cancel(); });
}

void DeadlineTimers::Post(std::function<void()> work) {
  boost::asio::post(io_, Scoped(std::move(work)));
}

}  // namespace layercast::server
