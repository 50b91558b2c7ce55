#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/slice.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/dtype.h"
#include "server/memory_budget.h"
#include "server/server_metrics.h"

namespace layercast::server {

// One chunk as it goes on the wire: the cast bytes in a gRPC slice and their
// CRC-32C. gRPC counts the slice's references, so any number of streams can
// send the same bytes and the memory goes when the last of them is done.
struct CastChunk {
  grpc::Slice data;
  uint32_t crc32c = 0;
};

// What makes two chunks the same bytes: the elements of one tensor, cast
// from the master at one version to one dtype.
struct ChunkKey {
  uint32_t layer = 0;
  uint32_t tensor = 0;
  uint64_t element_begin = 0;
  uint64_t elements = 0;
  uint64_t version = 0;
  DType dtype = DType::kFloat32;

  friend bool operator==(const ChunkKey&, const ChunkKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const ChunkKey& key) {
    return H::combine(std::move(h), key.layer, key.tensor, key.element_begin, key.elements,
                      key.version, key.dtype);
  }
};

// Cast once, send to many. Data-parallel workers fetch the same layer at the
// same version at about the same time; the first stream to need a chunk casts
// it and keeps it here, and the streams behind it send the same slice. A
// stream that finds a chunk still being cast waits for that cast (one chunk's
// cast, well under a millisecond) instead of repeating it.
//
// A chunk is kept only if another reader (another peer: each worker has its
// own connection) has a stream of its layer open, or had one within
// `max_age`: a lone worker (inference, or one walk at a time) gains nothing
// from kept chunks and would pay for them in cold memory, every cast landing
// in a fresh buffer instead of one still in cache. Workers need not overlap:
// data-parallel workers a layer apart still share.
//
// Kept chunks are charged to the memory budget, and they are the first thing
// given up: a chunk is kept only if it fits in `capacity_bytes` (oldest kept
// chunks make room) and the budget grants it without anyone waiting; when a
// stream has to wait for budget, every kept chunk is dropped (see
// MemoryBudget::SetReclaimer). Nothing ever waits on a slow reader: a stream
// that falls behind finds its chunks dropped and casts its own. Kept chunks
// unused for `max_age` are dropped on the next miss.
//
// Thread-safe. Lock order: this cache, then the budget.
class SharedChunks {
 public:
  using Cast = absl::FunctionRef<absl::StatusOr<CastChunk>()>;

  SharedChunks(uint64_t capacity_bytes, std::chrono::steady_clock::duration max_age,
               MemoryBudget& budget, ServerMetrics& metrics);
  // Returns the budget of every kept chunk. REQUIRES: no call in progress.
  ~SharedChunks();

  // Every stream of `layer` from reader `peer` (grpc::ServerContext::peer())
  // calls BeginStream once before its first GetOrCast and EndStream once
  // when it is done.
  void BeginStream(uint32_t layer, const std::string& peer);
  void EndStream(uint32_t layer, const std::string& peer);

  // The chunk `key` of `bytes` bytes for a stream of `peer`: kept or being
  // cast by another stream, or cast here by `cast` (and kept when another
  // reader wants the layer and there is room). A failed cast is returned to
  // every stream that waited for it, and never kept.
  absl::StatusOr<CastChunk> GetOrCast(const ChunkKey& key, uint64_t bytes, const std::string& peer,
                                      Cast cast);

  // Drops every kept chunk that is not being cast, returning its budget.
  void DropAll();

  uint64_t kept_bytes() const;

 private:
  struct Entry {
    uint64_t bytes = 0;
    std::chrono::steady_clock::time_point last_used;
    absl::Notification ready;
    absl::StatusOr<CastChunk> chunk;  // written once, before `ready`
  };

  struct Reader {
    std::string peer;
    int open = 0;
    std::chrono::steady_clock::time_point last_seen;
  };

  // Whether a reader other than `peer` has `layer` open or had it lately.
  bool OthersWantLocked(uint32_t layer, const std::string& peer,
                        std::chrono::steady_clock::time_point now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes finished entries: all of them (`room` == UINT64_MAX), or the
  // least recently used until `room` more bytes fit, after first removing
  // those unused for max_age. Returns the bytes removed, for the caller to give back to the
  // budget once the lock is released.
  uint64_t EvictLocked(uint64_t room, std::chrono::steady_clock::time_point now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Forget(const ChunkKey& key, const std::shared_ptr<Entry>& entry);
  void GiveBack(uint64_t bytes);

  const uint64_t capacity_bytes_;
  const std::chrono::steady_clock::duration max_age_;
  MemoryBudget& budget_;
  ServerMetrics& metrics_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<ChunkKey, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // By layer; readers idle past max_age are dropped when a stream begins.
  absl::flat_hash_map<uint32_t, std::vector<Reader>> readers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::server
