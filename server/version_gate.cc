#include "server/version_gate.h"

#include <vector>

namespace layercast::server {

uint64_t VersionGate::version() const {
  absl::MutexLock lock(&mu_);
  return version_;
}

void VersionGate::Advance(uint64_t version) {
  std::vector<std::function<void()>> ready;
  {
    absl::MutexLock lock(&mu_);
    if (version <= version_) return;
    version_ = version;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->second.min_version <= version_) {
        ready.push_back(std::move(it->second.ready));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& callback : ready) callback();
}

uint64_t VersionGate::Wait(uint64_t min_version, std::function<void()> ready) {
  {
    absl::MutexLock lock(&mu_);
    if (min_version > version_) {
      const uint64_t id = next_id_++;
      waiters_.emplace(id, Waiter{min_version, std::move(ready)});
      return id;
    }
  }
  ready();
  return 0;
}

bool VersionGate::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  return waiters_.erase(id) > 0;
}

size_t VersionGate::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiters_.size();
}

}  // namespace layercast::server
