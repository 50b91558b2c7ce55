#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/serving/change_log.h"
#include "server/serving/deadline_timers.h"
#include "server/serving/memory_budget.h"
#include "server/serving/parameter_store.h"
#include "server/serving/server_metrics.h"

namespace layercast::server {

// Versions a layer has moved past, kept for a while so that a reader walking
// the model at version v gets v for every layer even after v+1 is committed
// (FetchLayerRequest.exact_version), and a stream that a change overtakes
// mid-layer finishes at the version it started with instead of failing.
// On a training shard, only the steps it records keep anything
// (ChangeLog::Wanted: after a pinned read, a delta pull or an overtaken
// stream); one not recording ends an overtaken stream with ABORTED, which
// the worker library gathers again, and that starts the recording.
//
// What is kept is the compute-dtype bits of this shard's slice of the layer
// as they were before the change: what the change log casts anyway to find
// what changed (ChangeLog::Take for a publish; for an optimizer step,
// ChangeLog::Recording writes its casts into the snapshot, often the bytes
// of the version evicted last: TakeSpare), so keeping it costs no cast. A change
// that changed no value keeps nothing: the next kept version (or the master)
// holds the same bits, and Find looks there.
//
// Bounded three ways: at most `per_layer` versions of each layer that no
// reader leased (the newest) and `per_layer` it leased, each for
// `retention`; charged to the memory budget, and only when
// the room left after it is at least as large again, so that streams still
// find memory without waiting; all dropped when a stream does wait for
// budget (the budget's reclaimer). A reader holding a Kept keeps its bytes
// (and their charge) until it lets go.
//
// Leases: a pinned read served at version v (Lease) holds v for
// `retention` from the read, on every layer: the kept version that serves
// v there (keyed v, or a later one the changes since left equal) is kept
// beside the `per_layer` newest unleased ones, and does not expire while
// leased. So a walk at v finishes however many versions commit during it,
// as long as each of its reads comes within `retention` of the one before,
// fewer than `per_layer` other walks lease newer versions of its layers,
// and the budget has room.
//
// Thread-safe. Lock order: a layer's mutex, then this, then the budget.
class PinnedVersions {
 public:
  // A layer's slice at one version.
  class Kept {
   public:
    ~Kept();
    Kept(const Kept&) = delete;
    Kept& operator=(const Kept&) = delete;

    // The compute-dtype bits of tensor `index`'s owned elements, the first
    // owned element first.
    const uint8_t* tensor(uint32_t index) const { return bits_.data() + offsets_[index]; }
    uint64_t bytes() const { return bits_.size(); }

   private:
    friend class PinnedVersions;
    Kept(std::vector<uint8_t> bits, std::vector<uint64_t> offsets, MemoryBudget& budget)
        : bits_(std::move(bits)), offsets_(std::move(offsets)), budget_(budget) {}
    // Not const: an evicted version no reader holds gives its bytes (and
    // their charge) to the next snapshot of its layer (TakeSpare).
    std::vector<uint8_t> bits_;
    const std::vector<uint64_t> offsets_;
    MemoryBudget& budget_;
  };

  // `retention` > 0. Everything referenced must outlive this; `timers`
  // (the shard's timer thread) too, or null for a thread of its own.
  // `per_layer` >= 1.
  PinnedVersions(const ParameterStore& store, std::chrono::steady_clock::duration retention,
                 size_t per_layer, MemoryBudget& budget, ServerMetrics& metrics,
                 DeadlineTimers* timers = nullptr);
  // Drops every kept version (readers still holding one keep it).
  ~PinnedVersions();

  // Keeps `before` as `layer` at `version`, the version the change that is
  // about to advance it ends, when the bounds above allow. `changed`: the
  // values the change changed (ChangeLog::Record's count); 0 keeps nothing.
  // REQUIRES: the layer's mutex held exclusively, before the layer's version
  // advances (a reader that sees the new version finds the old one here).
  void Keep(uint32_t layer, uint64_t version, uint64_t changed, ChangeLog::Snapshot&& before);

  // The bits of `layer` at `version`: kept under that version, or under a
  // later one that `changes` says changed nothing since `version`. Null when
  // neither (never kept, or dropped). REQUIRES: the layer's mutex held
  // (shared is enough), so the change log cannot move under the answer.
  std::shared_ptr<const Kept> Find(uint32_t layer, uint64_t version,
                                   const ChangeLog& changes) const;

  // A pinned reader read (or waits to read) `version`: hold it, on every
  // layer, for `retention` from now.
  void Lease(uint64_t version);

  size_t per_layer() const { return per_layer_; }

  // Drops every kept version (the budget's reclaimer calls it when a
  // stream has to wait for memory).
  void DropAll();

  // The bytes of `layer`'s last evicted version, when no reader held it,
  // for the next snapshot of the layer to be cast into (ChangeLog::
  // Recording): a training step allocates and faults in no fresh memory
  // once its layer has two kept versions. Empty when there are none. Their
  // charge is given back here; Keep charges them again.
  std::vector<uint8_t> TakeSpare(uint32_t layer);

 private:
  struct Entry {
    std::shared_ptr<const Kept> kept;
    std::chrono::system_clock::time_point superseded;  // for the age gauge
    DeadlineTimers::Handle expiry;
  };
  using Key = std::pair<uint32_t, uint64_t>;  // layer, version

  // Whether the budget has room for `bytes` and as much again after it.
  bool Affordable(uint64_t bytes) const;
  void Expire(Key key);
  // Removes every entry; returns them, to be released after the lock.
  std::map<Key, Entry> TakeAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the spares and gives their charge back (lock order: this, then
  // the budget, which runs no other code inline).
  void ReleaseSparesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Until when a reader's lease holds `entry`: the latest lease on a
  // version it serves (Find), if one runs past `now`.
  std::optional<std::chrono::steady_clock::time_point> LeasedUntilLocked(
      std::map<Key, Entry>::const_iterator entry, std::chrono::steady_clock::time_point now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops `layer`'s oldest unleased and oldest leased entries beyond
  // per_layer_ each, into `evicted` (to be released after the lock).
  void EvictLocked(uint32_t layer, std::vector<std::shared_ptr<const Kept>>& evicted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the gauges from what is kept now (at most twice per_layer_
  // entries a layer, so the scan is short).
  void ObserveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ParameterStore& store_;
  const std::chrono::steady_clock::duration retention_;
  const size_t per_layer_;
  MemoryBudget& budget_;
  ServerMetrics& metrics_;

  mutable absl::Mutex mu_;
  std::map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // Per leased version, until when.
  std::map<uint64_t, std::chrono::steady_clock::time_point> leases_ ABSL_GUARDED_BY(mu_);
  // Per layer, at most one evicted version's bytes, still charged.
  std::map<uint32_t, std::vector<uint8_t>> spare_ ABSL_GUARDED_BY(mu_);
  DeadlineTimers timers_;  // last: see DeadlineTimers
};

}  // namespace layercast::server
