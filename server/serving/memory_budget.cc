#include "server/serving/memory_budget.h"

#include <algorithm>

#include <boost/asio/post.hpp>

namespace layercast::server {

MemoryBudget::MemoryBudget(std::optional<uint64_t> budget_bytes, uint64_t master_bytes,
                           boost::asio::any_io_executor grants, Observer observer,
                           DeadlineTimers* timers)
    : budget_(budget_bytes),
      master_bytes_(master_bytes),
      grants_(std::move(grants)),
      observer_(std::move(observer)),
      in_use_(master_bytes),
      peak_(master_bytes),
      timers_(timers) {}

MemoryBudget::~MemoryBudget() {
  // Before timers_ goes: no waiter's timer may fire into a gone owner.
  absl::MutexLock lock(&mu_);
  for (const Waiter& waiter : waiters_) timers_.Cancel(waiter.timer);
  waiters_.clear();
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

void MemoryBudget::Post(Granted granted, bool ok) {
  boost::asio::post(grants_, [granted = std::move(granted), ok] { granted(ok); });
}

void MemoryBudget::GrantWaitersLocked() {
  while (!waiters_.empty() && FitsLocked(waiters_.front().bytes)) {
    Waiter& head = waiters_.front();
    in_use_ += head.bytes;
    peak_ = std::max(peak_, in_use_);
    timers_.Cancel(head.timer);
    Post(std::move(head.granted), true);
    waiters_.pop_front();
  }
}

uint64_t MemoryBudget::Acquire(uint64_t bytes, std::chrono::steady_clock::time_point give_up_at,
                               Granted granted) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  if (waiters_.empty() && FitsLocked(bytes)) {
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
    NotifyLocked();
    Post(std::move(granted), true);
    return id;
  }
  DeadlineTimers::Handle timer = timers_.Schedule(give_up_at, [this, id] { Expire(id); });
  waiters_.push_back(Waiter{id, bytes, std::move(granted), std::move(timer)});
  NotifyLocked();
  if (reclaim_) timers_.Post(reclaim_);
  return id;
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

bool MemoryBudget::RemoveLocked(uint64_t id) {
  auto it =
      std::find_if(waiters_.begin(), waiters_.end(), [id](const Waiter& w) { return w.id == id; });
  if (it == waiters_.end()) return false;
  const bool was_head = it == waiters_.begin();
  timers_.Cancel(it->timer);
  waiters_.erase(it);
  // A large request at the head may have held back smaller ones that fit.
  if (was_head) GrantWaitersLocked();
  NotifyLocked();
  return true;
}

bool MemoryBudget::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  return RemoveLocked(id);
}

void MemoryBudget::Expire(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it =
      std::find_if(waiters_.begin(), waiters_.end(), [id](const Waiter& w) { return w.id == id; });
  if (it == waiters_.end()) return;
  Post(std::move(it->granted), false);
  RemoveLocked(id);
}

void MemoryBudget::Charge(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  NotifyLocked();
}

void MemoryBudget::Release(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  in_use_ -= std::min(in_use_, bytes);
  GrantWaitersLocked();
  NotifyLocked();
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
