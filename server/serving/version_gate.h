#pragma once

#include <boost/asio/any_io_executor.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/serving/deadline_timers.h"

namespace layercast::server {

// The parameter version of every layer of the shard (optimizer steps
// applied to it), and the streams waiting for a layer to reach a
// `min_version`. The model's version is its lowest layer's. Reactors never block on it: they
// register a callback, which is always posted to `executor`, never run on the thread that calls
// Wait, Advance, Cancel or Close. So a reactor's constructor never starts writing, and a waiter's
// callback never runs inside another stream's code.
//
// Thread-safe.
class VersionGate {
 public:
  enum class Outcome {
    kReached,   // version() >= min_version
    kTimedOut,  // give_up_at came first
    kClosed,    // Close() came first: the shard is shutting down
  };
  // Gets the outcome and the version when it was decided.
  using Ready = std::function<void(Outcome outcome, uint64_t version)>;

  // `executor` runs every callback; it must outlive the gate's waiters.
  // Until SetLayers, the model is one version with no layers of its own.
  // `timers`: the shard's timer thread (must outlive this); null: a thread
  // of its own.
  explicit VersionGate(boost::asio::any_io_executor executor, uint64_t version = 0,
                       DeadlineTimers* timers = nullptr);
  // Forgets waiters still registered (their callbacks never run).
  ~VersionGate();

  // Gives the model `layers` layers, each at the model's version so far;
  // nothing changes when it has that many already. Called when the
  // parameters are loaded, before any per-layer call.
  void SetLayers(uint32_t layers);

  // The model's version: its lowest layer's.
  uint64_t version() const;
  // REQUIRES for every per-layer call: layer < the layers set.
  uint64_t version(uint32_t layer) const;
  // Every layer's version, in layer order.
  std::vector<uint64_t> versions() const;

  // Raises every layer to at least `version` (never lowers one) and posts
  // every waiter now reached.
  void Advance(uint64_t version);
  // Raises `layer` to `version`, likewise.
  void Advance(uint32_t layer, uint64_t version);

  // Sets the model's (every layer's) version, or one layer's, to exactly
  // `version`, lower or not: a relay whose shards started counting again
  // follows them down. Posts every waiter now reached.
  void Set(uint64_t version);
  void Set(uint32_t layer, uint64_t version);

  // Posts `ready` once version() >= min_version (at once if it already is),
  // at `give_up_at` (time_point::max(): never), or at Close(), whichever
  // comes first. Returns an id for Cancel.
  uint64_t Wait(uint64_t min_version, std::chrono::steady_clock::time_point give_up_at,
                Ready ready);
  // The same for one layer's version.
  uint64_t Wait(uint32_t layer, uint64_t min_version,
                std::chrono::steady_clock::time_point give_up_at, Ready ready);

  // Forgets waiter `id`. True if it was still waiting (so `ready` will never
  // run); false if its callback has been posted.
  bool Cancel(uint64_t id);

  // Posts kClosed to every waiter, and to every later Wait not reached at
  // once. The drain calls it: parked streams end at once instead of holding
  // the shutdown.
  void Close();

  // Waiters registered and not yet posted or cancelled.
  size_t waiting() const;

 private:
  // A waiter for the model's version rather than one layer's.
  static constexpr uint32_t kModel = UINT32_MAX;

  struct Waiter {
    uint32_t layer;  // or kModel
    uint64_t min_version;
    Ready ready;
    DeadlineTimers::Handle timer;  // null without a give-up time
  };
  // Removes waiter `it`, cancels its timer and posts its callback.
  void PostLocked(std::map<uint64_t, Waiter>::iterator it, Outcome outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Post(Ready ready, Outcome outcome, uint64_t version);
  uint64_t VersionLocked(uint32_t layer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Posts every waiter whose version is now reached.
  void PostReachedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t WaitLocked(uint32_t layer, uint64_t min_version,
                      std::chrono::steady_clock::time_point give_up_at, Ready ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const boost::asio::any_io_executor executor_;
  mutable absl::Mutex mu_;
  uint64_t version_ ABSL_GUARDED_BY(mu_);  // the model's: the lowest layer's
  std::vector<uint64_t> layers_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  DeadlineTimers timers_;  // last: see DeadlineTimers
};

}  // namespace layercast::server
