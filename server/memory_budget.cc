#include "server/memory_budget.h"

#include <algorithm>

#include <boost/asio/post.hpp>

namespace layercast::server {

MemoryBudget::MemoryBudget(std::optional<uint64_t> budget_bytes, uint64_t master_bytes,
                           Observer observer)
    : budget_(budget_bytes),
      master_bytes_(master_bytes),
      observer_(std::move(observer)),
      in_use_(master_bytes),
      peak_(master_bytes),
      keep_running_(boost::asio::make_work_guard(timers_)),
      timer_thread_([this] { timers_.run(); }) {}

MemoryBudget::~MemoryBudget() {
  keep_running_.reset();
  timers_.stop();
  timer_thread_.join();
}

bool MemoryBudget::FitsLocked(uint64_t bytes) const {
  return !budget_ || (in_use_ <= *budget_ && bytes <= *budget_ - in_use_);
}

bool MemoryBudget::Grantable(uint64_t bytes) const {
  return !budget_ || (master_bytes_ <= *budget_ && bytes <= *budget_ - master_bytes_);
}

void MemoryBudget::NotifyLocked() {
  if (observer_) observer_(in_use_, waiters_.size());
}

void MemoryBudget::GrantWaitersLocked(std::vector<Granted>& ready) {
  while (!waiters_.empty() && FitsLocked(waiters_.front().bytes)) {
    Waiter& head = waiters_.front();
    in_use_ += head.bytes;
    peak_ = std::max(peak_, in_use_);
    CancelTimer(head.timer);
    ready.push_back(std::move(head.granted));
    waiters_.pop_front();
  }
}

void MemoryBudget::CancelTimer(const std::shared_ptr<boost::asio::steady_timer>& timer) {
  // Timers belong to the timer thread; cancel them there.
  if (timer) boost::asio::post(timers_, [timer] { timer->cancel(); });
}

uint64_t MemoryBudget::Acquire(uint64_t bytes, std::chrono::steady_clock::time_point give_up_at,
                               Granted granted) {
  {
    absl::MutexLock lock(&mu_);
    if (!waiters_.empty() || !FitsLocked(bytes)) {
      const uint64_t id = next_id_++;
      auto timer = std::make_shared<boost::asio::steady_timer>(timers_, give_up_at);
      timer->async_wait([this, id](const boost::system::error_code& error) {
        if (!error) Expire(id);
      });
      waiters_.push_back(Waiter{id, bytes, std::move(granted), std::move(timer)});
      NotifyLocked();
      // Not on this thread: the reclaimer's Release() may grant this very
      // request, and the caller must see its id first.
      if (reclaim_) boost::asio::post(timers_, reclaim_);
      return id;
    }
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
    NotifyLocked();
  }
  granted(true);
  return 0;
}

bool MemoryBudget::TryAcquire(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!waiters_.empty() || !FitsLocked(bytes)) return false;
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  NotifyLocked();
  return true;
}

void MemoryBudget::SetReclaimer(std::function<void()> reclaim) {
  absl::MutexLock lock(&mu_);
  reclaim_ = std::move(reclaim);
}

bool MemoryBudget::RemoveLocked(uint64_t id, std::vector<Granted>& ready) {
  auto it =
      std::find_if(waiters_.begin(), waiters_.end(), [id](const Waiter& w) { return w.id == id; });
  if (it == waiters_.end()) return false;
  const bool was_head = it == waiters_.begin();
  CancelTimer(it->timer);
  waiters_.erase(it);
  // A large request at the head may have held back smaller ones that fit.
  if (was_head) GrantWaitersLocked(ready);
  NotifyLocked();
  return true;
}

bool MemoryBudget::Cancel(uint64_t id) {
  std::vector<Granted> ready;
  bool removed;
  {
    absl::MutexLock lock(&mu_);
    removed = RemoveLocked(id, ready);
  }
  for (Granted& callback : ready) callback(true);
  return removed;
}

void MemoryBudget::Expire(uint64_t id) {
  std::vector<Granted> ready;
  Granted expired;
  {
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(waiters_.begin(), waiters_.end(),
                           [id](const Waiter& w) { return w.id == id; });
    if (it == waiters_.end()) return;
    expired = std::move(it->granted);
    RemoveLocked(id, ready);
  }
  expired(false);
  for (Granted& callback : ready) callback(true);
}

void MemoryBudget::Release(uint64_t bytes) {
  std::vector<Granted> ready;
  {
    absl::MutexLock lock(&mu_);
    in_use_ -= std::min(in_use_, bytes);
    GrantWaitersLocked(ready);
    NotifyLocked();
  }
  for (Granted& callback : ready) callback(true);
}

uint64_t MemoryBudget::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

uint64_t MemoryBudget::peak() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}

size_t MemoryBudget::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiters_.size();
}

}  // namespace layercast::server
