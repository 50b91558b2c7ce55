#pragma once

#include <cstdint>
#include <functional>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace layercast::server {

// The shard's parameter version, and the streams waiting for it to reach a
// `min_version`. Reactors never block on it: they register a callback and
// are called back when the version arrives.
//
// Thread-safe.
class VersionGate {
 public:
  explicit VersionGate(uint64_t version = 0) : version_(version) {}

  uint64_t version() const;

  // Raises the version to `version` (never lowers it) and runs, outside the
  // lock, every waiter whose min_version is now reached.
  void Advance(uint64_t version);

  // Runs `ready` once version() >= min_version: at once, on this thread, if
  // it already is (and returns 0); else later from Advance() (and returns a
  // non-zero id for Cancel).
  uint64_t Wait(uint64_t min_version, std::function<void()> ready);

  // Forgets waiter `id`. True if it was still waiting (so `ready` will never
  // run); false if it already ran or is running.
  bool Cancel(uint64_t id);

  // Waiters registered and not yet run or cancelled.
  size_t waiting() const;

 private:
  struct Waiter {
    uint64_t min_version;
    std::function<void()> ready;
  };
  mutable absl::Mutex mu_;
  uint64_t version_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::server
