#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/change_log.h"
#include "server/deadline_timers.h"
#include "server/memory_budget.h"
#include "server/parameter_store.h"
#include "server/server_metrics.h"

namespace layercast::server {

// Versions a layer has moved past, kept for a while so that a reader walking
// the model at version v gets v for every layer even after v+1 is committed
// (FetchLayerRequest.exact_version), and a stream that a change overtakes
// mid-layer finishes at the version it started with instead of failing.
//
// What is kept is the compute-dtype bits of this shard's slice of the layer
// as they were before the change: the snapshot ChangeLog::Take makes anyway
// to find what changed, so keeping it costs no cast and no copy. Each kept
// version is charged to the memory budget (only when it fits without anyone
// waiting: it never delays a stream that needs memory) and is dropped after
// `retention`, when a stream has to wait for budget, or when the shard
// stops. A reader still sending from a dropped version keeps its bytes
// until its chunk is cast; the budget is given back when the last reader
// lets go.
//
// Thread-safe. Lock order: this, then the budget.
class PinnedVersions {
 public:
  // A layer's slice at one version.
  class Kept {
   public:
    ~Kept();
    Kept(const Kept&) = delete;
    Kept& operator=(const Kept&) = delete;

    // The compute-dtype bits of tensor `tensor`'s owned elements, the first
    // owned element first.
    const uint8_t* tensor(uint32_t tensor) const { return bits_.data() + offsets_[tensor]; }
    uint64_t bytes() const { return bits_.size(); }

   private:
    friend class PinnedVersions;
    Kept(std::vector<uint8_t> bits, std::vector<uint64_t> offsets, MemoryBudget& budget)
        : bits_(std::move(bits)), offsets_(std::move(offsets)), budget_(budget) {}
    const std::vector<uint8_t> bits_;
    const std::vector<uint64_t> offsets_;
    MemoryBudget& budget_;
  };

  // `retention` > 0. Everything referenced must outlive this.
  PinnedVersions(const ParameterStore& store, std::chrono::steady_clock::duration retention,
                 MemoryBudget& budget, ServerMetrics& metrics);
  // Drops every kept version (readers still holding one keep it).
  ~PinnedVersions();

  std::chrono::steady_clock::duration retention() const { return retention_; }

  // Keeps `before` as `layer` at `version`, the version the change that is
  // about to advance it ends, when the budget has room now. REQUIRES: the
  // layer's mutex held exclusively, before the layer's version advances (a
  // reader that sees the new version finds the old one here).
  void Keep(uint32_t layer, uint64_t version, ChangeLog::Snapshot&& before);

  // `layer` at `version`, or null when it is not kept (never was, or was
  // dropped).
  std::shared_ptr<const Kept> Find(uint32_t layer, uint64_t version) const;

  // Drops every kept version (the budget's reclaimer calls it when a
  // stream has to wait for memory).
  void DropAll();

 private:
  struct Entry {
    std::shared_ptr<const Kept> kept;
    std::chrono::system_clock::time_point superseded;  // for the age gauge
    DeadlineTimers::Handle expiry;
  };
  using Key = std::pair<uint32_t, uint64_t>;  // layer, version

  void Expire(Key key);
  // Drops every kept version; how many.
  size_t Drop();
  // Sets the gauges from what is kept now.
  void ObserveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ParameterStore& store_;
  const std::chrono::steady_clock::duration retention_;
  MemoryBudget& budget_;
  ServerMetrics& metrics_;

  mutable absl::Mutex mu_;
  std::map<Key, Entry> entries_ ABSL_GUARDED_BY(mu_);
  DeadlineTimers timers_;  // last: see DeadlineTimers
};

}  // namespace layercast::server
