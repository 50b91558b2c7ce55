#include "client/cancellation.h"

namespace layercast::client {

void Cancellation::Cancel() {
  // Callbacks run under the lock so Unregister can promise they are done.
  absl::MutexLock lock(&mu_);
  if (cancelled_) return;
  cancelled_ = true;
  for (auto& [id, callback] : callbacks_) callback();
  callbacks_.clear();
}

bool Cancellation::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

uint64_t Cancellation::Register(std::function<void()> on_cancel) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) {
    on_cancel();
    return 0;
  }
  const uint64_t id = next_id_++;
  callbacks_.emplace(id, std::move(on_cancel));
  return id;
}

void Cancellation::Unregister(uint64_t id) {
  absl::MutexLock lock(&mu_);
  callbacks_.erase(id);
}

}  // namespace layercast::client
