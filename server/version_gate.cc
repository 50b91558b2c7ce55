#include "server/version_gate.h"

#include <boost/asio/post.hpp>

namespace layercast::server {

VersionGate::VersionGate(boost::asio::any_io_executor executor, uint64_t version)
    : executor_(std::move(executor)), version_(version) {}

VersionGate::~VersionGate() {
  // Before timers_ goes: a waiter's timer must not outlive its io_context.
  absl::MutexLock lock(&mu_);
  for (auto& [id, waiter] : waiters_) timers_.Cancel(waiter.timer);
  waiters_.clear();
}

uint64_t VersionGate::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

void VersionGate::Post(Ready ready, Outcome outcome, uint64_t version) {
  boost::asio::post(executor_,
                    [ready = std::move(ready), outcome, version] { ready(outcome, version); });
}

void VersionGate::PostLocked(std::map<uint64_t, Waiter>::iterator it, Outcome outcome) {
  timers_.Cancel(it->second.timer);
  Post(std::move(it->second.ready), outcome, version_);
  waiters_.erase(it);
}

void VersionGate::Advance(uint64_t version) {
  absl::MutexLock lock(&mu_);
  if (version <= version_) return;
  version_ = version;
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    auto next = std::next(it);
    if (it->second.min_version <= version_) PostLocked(it, Outcome::kReached);
    it = next;
  }
}

uint64_t VersionGate::Wait(uint64_t min_version, std::chrono::steady_clock::time_point give_up_at,
                           Ready ready) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  if (min_version <= version_ || closed_) {
    Post(std::move(ready), min_version <= version_ ? Outcome::kReached : Outcome::kClosed,
         version_);
    return id;
  }
  DeadlineTimers::Handle timer = timers_.Schedule(give_up_at, [this, id] {
    absl::MutexLock lock(&mu_);
    if (auto it = waiters_.find(id); it != waiters_.end()) PostLocked(it, Outcome::kTimedOut);
  });
  waiters_.emplace(id, Waiter{min_version, std::move(ready), std::move(timer)});
  return id;
}

bool VersionGate::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return false;
  timers_.Cancel(it->second.timer);
  waiters_.erase(it);
  return true;
}

void VersionGate::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  while (!waiters_.empty()) PostLocked(waiters_.begin(), Outcome::kClosed);
}

size_t VersionGate::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiters_.size();
}

}  // namespace layercast::server
