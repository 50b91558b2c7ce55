#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/serving/memory_budget.h"

namespace layercast::server {

// The fp32 staging buffers of gradient pushes whose step has applied, kept
// for the steps that follow. A push then widens its chunks into pages that
// are already mapped, instead of into a fresh allocation that the kernel
// faults in and zeroes page by page: one layer of a 70B model on 8 shards is
// 428 MB per push, some 100,000 page faults, more time than its bytes take on
// the wire.
//
// A pooled buffer stays charged to the budget, so the budget keeps counting
// the memory the shard holds. The pool keeps at most `max_bytes` (the
// trainer's: what every layer's step can reserve at once, so it holds at
// most the staging the steps held at their peak), drops the oldest buffer
// first when it would hold more, and gives way to the budget: a buffer returned while a request
// waits for budget is released to it, and everything is dropped when a request begins to wait
// (Drain: the shard's budget reclaimer calls it).
//
// Thread-safe.
class StagingPool {
 public:
  // `budget` null: nothing is charged (unit tests).
  StagingPool(uint64_t max_bytes, MemoryBudget* budget) : max_bytes_(max_bytes), budget_(budget) {}

  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // Up to `count` pooled buffers of exactly `elements` floats (contents
  // unspecified); their charge passes to the caller.
  std::vector<std::vector<float>> Claim(uint64_t elements, uint32_t count);
  // Takes a buffer whose bytes the caller has charged to the budget, with
  // that charge: kept if it fits, else (or as it makes room) released.
  void Give(std::vector<float> buffer);
  // Frees every buffer held and returns their charge to the budget.
  void Drain();
  uint64_t bytes() const;

 private:
  // Releases the charge of `buffers` (outside the lock: the budget may
  // grant waiting requests).
  void Free(std::vector<std::vector<float>> buffers);

  const uint64_t max_bytes_;
  MemoryBudget* const budget_;
  mutable absl::Mutex mu_;
  std::deque<std::vector<float>> buffers_ ABSL_GUARDED_BY(mu_);  // oldest first
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace layercast::server
