#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/slice.h>
#include <boost/asio/any_io_executor.hpp>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/dtype.h"
#include "server/serving/deadline_timers.h"
#include "server/serving/memory_budget.h"
#include "server/serving/server_metrics.h"

namespace layercast::server {

// One chunk as it goes on the wire: the cast bytes in a gRPC slice and their
// CRC-32C. gRPC counts the slice's references, so any number of streams can
// send the same bytes and the memory goes when the last of them is done.
struct CastChunk {
  grpc::Slice data;
  uint32_t crc32c = 0;
  // `data` is a whole LayerChunk message (a delta chunk), sent as it is.
  bool framed = false;
  // The last `scale_bytes` of `data` are the block scales of an 8-bit
  // float chunk (LayerChunk.scales), the rest its codes; the CRC covers both.
  uint64_t scale_bytes = 0;
};

// What makes two chunks the same bytes: the elements of one tensor, cast
// from the master at one version to one dtype, whole or as a delta from
// one base version.
struct ChunkKey {
  static constexpr uint64_t kWhole = UINT64_MAX;

  uint32_t layer = 0;
  uint32_t tensor = 0;
  uint64_t element_begin = 0;
  uint64_t elements = 0;
  uint64_t version = 0;
  DType dtype = DType::kFloat32;
  uint64_t base_version = kWhole;
  // A delta chunk whose positions may go as gaps (its reader takes them).
  bool gaps = false;

  friend bool operator==(const ChunkKey&, const ChunkKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const ChunkKey& key) {
    return H::combine(std::move(h), key.layer, key.tensor, key.element_begin, key.elements,
                      key.version, key.dtype, key.base_version, key.gaps);
  }
};

// Cast once, send to many. Data-parallel workers fetch the same layer at the
// same version at about the same time; the first stream to need a chunk casts
// it and keeps it here, and the streams behind it send the same slice. A
// stream that finds a chunk still being cast is resumed when that cast (one
// chunk's, well under a millisecond) is done, instead of repeating it; it
// never blocks a thread while it waits.
//
// A chunk is kept only while another stream of its layer is open: a lone
// worker (inference, or one walk at a time) gains nothing from kept chunks
// and would pay for them in cold memory, every cast landing in a fresh
// buffer instead of one still in cache. Workers need not be in step: a
// worker a few chunks behind another still sends what the other cast, as
// long as their streams of the layer overlap; when the layer's last stream
// ends, its kept chunks go. Streams are counted, not readers: a reader
// that reconnects (a new connection per walk) leaves nothing behind, and
// one worker's two streams of a layer share.
//
// A stream of a layer nobody else reads, with nothing kept of it, takes no
// lock and no hash per chunk: it reads two counters of the layer's slot.
//
// Kept chunks are charged to the memory budget, and they are the first thing
// given up: a chunk is kept only if it fits in `capacity_bytes` (the least
// recently used kept chunks make room) and the budget grants it without
// anyone waiting; when a stream has to wait for budget, every kept chunk is
// dropped (see MemoryBudget::SetReclaimer); a sweep on the timer thread drops chunks
// unused for `max_idle`. Nothing ever waits on a slow reader: a stream that
// falls behind finds its chunks dropped and casts its own.
//
// Thread-safe. Lock order: this cache, then the budget.
class SharedChunks {
 public:
  using Cast = absl::FunctionRef<absl::StatusOr<CastChunk>()>;
  using Resume = std::function<void(absl::StatusOr<CastChunk>)>;

  // `resumes` runs the Resume callbacks of streams that waited for another
  // stream's cast; it must outlive them. The sweeper runs on `timers` (the
  // shard's timer thread, which must outlive this; its own when null) and
  // reads its clock.
  SharedChunks(uint64_t capacity_bytes, std::chrono::steady_clock::duration max_idle,
               MemoryBudget& budget, ServerMetrics& metrics, boost::asio::any_io_executor resumes,
               DeadlineTimers* timers = nullptr);
  // Stops the sweeper and returns the budget of every kept chunk.
  // REQUIRES: no call in progress.
  ~SharedChunks();

  // Every stream of `layer` calls BeginStream once before its first
  // GetOrCast and EndStream once when it is done; the last EndStream of a
  // layer drops its kept chunks.
  void BeginStream(uint32_t layer);
  void EndStream(uint32_t layer);

  // The chunk `key` of `bytes` bytes for an open stream of its layer:
  // returned at once when it is kept (counted as shared), or cast here by
  // `cast` (and kept when another stream of the layer is open and there is
  // room). When
  // another stream is casting it right now, returns nullopt and posts
  // `resume` with the chunk (counted as shared) once that cast is done. A
  // failed cast goes to every stream that waited for it, and is never kept.
  std::optional<absl::StatusOr<CastChunk>> GetOrCast(const ChunkKey& key, uint64_t bytes, Cast cast,
                                                     Resume resume);

  // Drops every kept chunk that is not being cast, returning its budget.
  void DropAll();
  // Drops the kept chunks of `layer` (a worker saw one fail its checksum).
  void DropLayer(uint32_t layer);
  // Drops kept chunks unused for max_idle (the sweeper calls it).
  void DropIdle();

  uint64_t kept_bytes() const;

 private:
  // Guarded by the cache's mutex.
  struct Entry {
    uint64_t bytes = 0;
    std::chrono::steady_clock::time_point last_used;
    bool ready = false;
    absl::StatusOr<CastChunk> chunk;  // set once, with `ready`
    std::vector<Resume> waiting;      // streams to resume when it is ready
  };

  // What GetOrCast reads without the lock: the open streams and the
  // entries (kept or being cast) of the layers that hash to the slot. A
  // slot shared by two layers only sends more chunks down the locked path.
  struct Slot {
    std::atomic<int> open{0};
    std::atomic<int> entries{0};
  };
  static constexpr size_t kSlots = 1024;
  Slot& SlotOf(uint32_t layer) { return slots_[layer % kSlots]; }

  // Whether a stream besides the caller's has `layer` open.
  bool OthersWantLocked(uint32_t layer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each removes finished entries and returns their bytes, for the caller to
  // give back to the budget once the lock is released: those unused for
  // max_idle (all of them when `all`); or the least recently used until
  // `room` more bytes fit in the capacity.
  uint64_t DropIdleLocked(std::chrono::steady_clock::time_point now, bool all)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t MakeRoomLocked(uint64_t room) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t RemoveLocked(absl::flat_hash_map<ChunkKey, std::shared_ptr<Entry>>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the finished entries of `layer`; returns their bytes.
  uint64_t DropLayerLocked(uint32_t layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Drop(bool all);
  void Forget(const ChunkKey& key, const std::shared_ptr<Entry>& entry);
  void GiveBack(uint64_t bytes);
  // The sweeper: DropIdle, twice per max_idle.
  void ScheduleSweep();

  const uint64_t capacity_bytes_;
  const std::chrono::steady_clock::duration max_idle_;
  MemoryBudget& budget_;
  ServerMetrics& metrics_;
  const boost::asio::any_io_executor resumes_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<ChunkKey, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Open streams by layer (layers with none are absent).
  absl::flat_hash_map<uint32_t, int> open_ ABSL_GUARDED_BY(mu_);
  Slot slots_[kSlots];
  DeadlineTimers timers_;  // last: see DeadlineTimers
};

}  // namespace layercast::server
