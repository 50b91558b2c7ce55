#include "server/serving/deadline_timers.h"

#include <boost/asio/post.hpp>
#include <cstdlib>
#include <vector>

#include "absl/synchronization/notification.h"
#include "platform/log.h"

namespace layercast::server {

struct DeadlineTimers::Timer {
  Timer(boost::asio::io_context& io, platform::Clock::TimePoint at, const Scope* owner,
        std::function<void()> expired)
      : wait(io, at), at(at), owner(owner), expired(std::move(expired)) {}
  boost::asio::steady_timer wait;  // on the steady clock only
  const platform::Clock::TimePoint at;
  const Scope* const owner;             // whose timer: dropped with it
  const std::function<void()> expired;  // runs only while its owner lives
  std::atomic<bool> cancelled{false};
};

DeadlineTimers::DeadlineTimers(DeadlineTimers* shared)
    : own_(shared == nullptr ? std::make_unique<Thread>() : nullptr),
      io_(shared == nullptr ? own_->io : shared->io_),
      clock_(shared == nullptr ? platform::Clock::Steady() : shared->clock_),
      steady_(shared == nullptr || shared->steady_),
      pending_(shared == nullptr ? nullptr : shared->pending_) {}

DeadlineTimers::DeadlineTimers(platform::Clock& clock)
    : own_(std::make_unique<Thread>()),
      io_(own_->io),
      clock_(clock),
      steady_(&clock == &platform::Clock::Steady()),
      pending_(steady_ ? nullptr : std::make_shared<Pending>(clock)) {
  if (!steady_) clock_.Listen(this);
}

DeadlineTimers::~DeadlineTimers() {
  // First: a jump under way waits for the thread's callbacks.
  if (own_ != nullptr && !steady_) clock_.Unlisten(this);
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
  if (pending_ != nullptr) {
    absl::MutexLock lock(&pending_->mu);
    std::erase_if(pending_->timers,
                  [this](const auto& entry) { return entry.second->owner == scope_.get(); });
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

DeadlineTimers::Handle DeadlineTimers::Schedule(platform::Clock::TimePoint at,
                                                std::function<void()> expired) {
  if (at == platform::Clock::TimePoint::max()) return nullptr;
  auto timer = std::make_shared<Timer>(io_, at, scope_.get(), Scoped(std::move(expired)));
  if (!steady_) {
    {
      absl::MutexLock lock(&pending_->mu);
      pending_->timers.emplace(at, timer);
    }
    if (at <= clock_.Now()) boost::asio::post(io_, [pending = pending_] { pending->RunDue(); });
    return timer;
  }
  // The handler holds the timer while it waits, so a Handle dropped by its
  // owner leaves it to run or be cancelled.
  timer->wait.async_wait([timer](const boost::system::error_code& error) {
    if (!error && !timer->cancelled.load()) timer->expired();
  });
  return timer;
}

void DeadlineTimers::Cancel(const Handle& timer) {
  if (!timer) return;
  timer->cancelled = true;
  if (!steady_) {
    absl::MutexLock lock(&pending_->mu);
    const auto [first, last] = pending_->timers.equal_range(timer->at);
    for (auto it = first; it != last; ++it) {
      if (it->second == timer) {
        pending_->timers.erase(it);
        break;
      }
    }
    return;
  }
  // An Asio timer belongs to the timer thread; its wait is cancelled there.
  boost::asio::post(io_, [timer] { timer->wait.cancel(); });
}

void DeadlineTimers::Post(std::function<void()> work) {
  boost::asio::post(io_, Scoped(std::move(work)));
}

void DeadlineTimers::Jumped() {
  auto ran = std::make_shared<absl::Notification>();
  boost::asio::post(io_, [pending = pending_, ran] {
    pending->RunDue();
    ran->Notify();
  });
  ran->WaitForNotification();
}

void DeadlineTimers::Pending::RunDue() {
  // Again until none is due: a callback may schedule one due already, which
  // the jump that is running them must run too. Each round runs at least one.
  for (;;) {
    Handle timer;
    {
      absl::MutexLock lock(&mu);
      if (timers.empty() || timers.begin()->first > clock.Now()) return;
      timer = std::move(timers.begin()->second);
      timers.erase(timers.begin());
    }
    if (!timer->cancelled.load()) timer->expired();
  }
}

}  // namespace layercast::server
