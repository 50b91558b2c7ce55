#pragma once

#include <cstdint>
#include <functional>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace layercast::client {

// A one-way switch that work in progress listens to: Cancel() runs every
// registered callback once (and runs later registrations at once), so a
// gather blocked on its streams can cancel them.
//
// Thread-safe.
class Cancellation {
 public:
  void Cancel();
  bool cancelled() const;

  // Runs `on_cancel` when Cancel() is called, or at once if it was. Returns
  // an id for Unregister (0 if it ran at once).
  uint64_t Register(std::function<void()> on_cancel);
  // After Unregister returns, the callback is not running and will not run.
  void Unregister(uint64_t id);

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::function<void()>> callbacks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::client
