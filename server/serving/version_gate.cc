#include "server/serving/version_gate.h"

#include <boost/asio/post.hpp>

#include <algorithm>

namespace layercast::server {

VersionGate::VersionGate(boost::asio::any_io_executor executor, uint64_t version,
                         DeadlineTimers* timers)
    : executor_(std::move(executor)), version_(version), timers_(timers) {}

VersionGate::~VersionGate() {
  // Before timers_ goes: no waiter's timer may fire into a gone owner.
  absl::MutexLock lock(&mu_);
  for (auto& [id, waiter] : waiters_) timers_.Cancel(waiter.timer);
  waiters_.clear();
}

void VersionGate::SetLayers(uint32_t layers) {
  absl::MutexLock lock(&mu_);
  if (layers_.size() == layers) return;
  layers_.assign(layers, version_);
}

uint64_t VersionGate::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

uint64_t VersionGate::version(uint32_t layer) const {
  absl::MutexLock lock(&mu_);
  return VersionLocked(layer);
}

std::vector<uint64_t> VersionGate::versions() const {
  absl::MutexLock lock(&mu_);
  return layers_;
}

uint64_t VersionGate::VersionLocked(uint32_t layer) const {
  return layer == kModel ? version_ : layers_[layer];
}

void VersionGate::Post(Ready ready, Outcome outcome, uint64_t version) {
  boost::asio::post(executor_,
                    [ready = std::move(ready), outcome, version] { ready(outcome, version); });
}

void VersionGate::PostLocked(std::map<uint64_t, Waiter>::iterator it, Outcome outcome) {
  timers_.Cancel(it->second.timer);
  Post(std::move(it->second.ready), outcome, VersionLocked(it->second.layer));
  waiters_.erase(it);
}

void VersionGate::PostReachedLocked() {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    auto next = std::next(it);
    if (it->second.min_version <= VersionLocked(it->second.layer)) {
      PostLocked(it, Outcome::kReached);
    }
    it = next;
  }
}

void VersionGate::Advance(uint64_t version) {
  absl::MutexLock lock(&mu_);
  if (version <= version_) return;
  for (uint64_t& layer : layers_) layer = std::max(layer, version);
  version_ = layers_.empty() ? version : *std::min_element(layers_.begin(), layers_.end());
  PostReachedLocked();
}

void VersionGate::Set(uint64_t version) {
  absl::MutexLock lock(&mu_);
  for (uint64_t& layer : layers_) layer = version;
  version_ = version;
  PostReachedLocked();
}

void VersionGate::Set(uint32_t layer, uint64_t version) {
  absl::MutexLock lock(&mu_);
  layers_[layer] = version;
  version_ = *std::min_element(layers_.begin(), layers_.end());
  PostReachedLocked();
}

void VersionGate::Advance(uint32_t layer, uint64_t version) {
  absl::MutexLock lock(&mu_);
  if (version <= layers_[layer]) return;
  layers_[layer] = version;
  version_ = *std::min_element(layers_.begin(), layers_.end());
  PostReachedLocked();
}

uint64_t VersionGate::Wait(uint64_t min_version, std::chrono::steady_clock::time_point give_up_at,
                           Ready ready) {
  absl::MutexLock lock(&mu_);
  return WaitLocked(kModel, min_version, give_up_at, std::move(ready));
}

uint64_t VersionGate::Wait(uint32_t layer, uint64_t min_version,
                           std::chrono::steady_clock::time_point give_up_at, Ready ready) {
  absl::MutexLock lock(&mu_);
  return WaitLocked(layer, min_version, give_up_at, std::move(ready));
}

uint64_t VersionGate::WaitLocked(uint32_t layer, uint64_t min_version,
                                 std::chrono::steady_clock::time_point give_up_at, Ready ready) {
  const uint64_t id = next_id_++;
  const uint64_t version = VersionLocked(layer);
  if (min_version <= version || closed_) {
    Post(std::move(ready), min_version <= version ? Outcome::kReached : Outcome::kClosed, version);
    return id;
  }
  DeadlineTimers::Handle timer = timers_.Schedule(give_up_at, [this, id] {
    absl::MutexLock lock(&mu_);
    if (auto it = waiters_.find(id); it != waiters_.end()) PostLocked(it, Outcome::kTimedOut);
  });
  waiters_.emplace(id, Waiter{layer, min_version, std::move(ready), std::move(timer)});
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
