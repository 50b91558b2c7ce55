#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include <grpcpp/support/slice.h>

#include "absl/status/statusor.h"
#include "server/serving/memory_budget.h"

namespace layercast::server {

// The buffers a shard casts chunks into, reused: a cast lands in memory
// already faulted in (and often still in cache) instead of a fresh
// std::malloc block, which glibc maps and unmaps for chunk-sized blocks, so
// every cast faulted its pages in again (issue 71: 98.6% of a shard's page
// faults, a cast into cold memory 28% slower).
//
// Take() hands out a gRPC slice over a pooled buffer; the slice's destroy
// callback, run when gRPC and every SharedChunks entry holding it are done,
// gives the buffer back. Buffers are made on demand and zeroed when made
// (faulted in once, there); the pool keeps at most `max_buffers` of them.
//
// Budget: each kept buffer is charged to `budget` from when the pool first
// keeps it (TryAcquire: never ahead of a waiting stream; a buffer the
// budget will not take is freed instead) until Drain() or the pool's end,
// whether idle or lent. A lent one is also within its stream's
// reservation, so it is counted twice while in flight, never less than
// once. Drain() (the budget's reclaimer) frees the idle ones and returns
// their budget.
//
// Thread-safe. Buffers may outlive the pool: they hold its state, and one
// that comes back after the pool is gone is freed.
class ChunkPool {
 public:
  // A slice of the bytes asked for, and where to write them (the slice's
  // own pointer is const).
  struct Lent {
    grpc::Slice slice;
    uint8_t* data = nullptr;
  };

  // Buffers of `buffer_bytes` (the largest chunk a stream casts whole),
  // at most `max_buffers` kept, charged to `budget`, which must outlive
  // the pool.
  ChunkPool(uint64_t buffer_bytes, size_t max_buffers, MemoryBudget& budget);
  // Frees the idle buffers and returns every kept buffer's budget.
  ~ChunkPool();
  ChunkPool(const ChunkPool&) = delete;
  ChunkPool& operator=(const ChunkPool&) = delete;

  // `bytes` to cast into: a pooled buffer when they fit one, else a
  // std::malloc block of their own (freed with the slice).
  // RESOURCE_EXHAUSTED when the memory is not there.
  absl::StatusOr<Lent> Take(uint64_t bytes);

  // Frees the idle buffers and returns their budget.
  void Drain();

  uint64_t buffer_bytes() const;
  size_t idle_buffers() const;
  // Buffers made so far: in steady state it stops growing.
  uint64_t buffers_made() const;
  // Bytes charged to the budget now.
  uint64_t charged_bytes() const;

 private:
  struct State;
  struct Buffer;
  // The slice's destroy callback.
  static void Return(void* buffer);

  std::shared_ptr<State> state_;
};

}  // namespace layercast::server
