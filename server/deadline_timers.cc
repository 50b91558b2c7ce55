#include "server/deadline_timers.h"

#include <boost/asio/post.hpp>

namespace layercast::server {

DeadlineTimers::DeadlineTimers()
    : keep_running_(boost::asio::make_work_guard(io_)), thread_([this] { io_.run(); }) {}

DeadlineTimers::~DeadlineTimers() {
  keep_running_.reset();
  io_.stop();
  thread_.join();
}

DeadlineTimers::Handle DeadlineTimers::Schedule(std::chrono::steady_clock::time_point at,
                                                std::function<void()> expired) {
  if (at == std::chrono::steady_clock::time_point::max()) return nullptr;
  auto timer = std::make_shared<boost::asio::steady_timer>(io_, at);
  // The handler holds the timer, so the timer is destroyed on the timer
  // thread (after the handler), whichever thread drops the last Handle.
  timer->async_wait([timer, expired = std::move(expired)](const boost::system::error_code& error) {
    if (!error) expired();
  });
  return timer;
}

void DeadlineTimers::Cancel(const Handle& timer) {
  // A timer belongs to the timer thread; it is cancelled there.
  if (timer) boost::asio::post(io_, [timer] { timer->cancel(); });
}

void DeadlineTimers::Post(std::function<void()> work) { boost::asio::post(io_, std::move(work)); }

}  // namespace layercast::server
