#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/layout.h"
#include "server/serving/memory_budget.h"
#include "server/serving/server_metrics.h"
#include "server/serving/shared_chunks.h"

namespace layercast::server {

// A read-only shard's cast cache (--cast-cache-bytes): each layer's
// compute-dtype bytes at the newest version read, kept as the reads cast
// them, so that a layer read again at that version (an inference fleet
// reading one version many times) is sent as slices of them, with no cast
// and no copy; a slice holds its layer until gRPC has sent it.
//
// Filled by the reads themselves: a stream that casts a chunk of the
// shard's grid (ChunkGrid) of a kept layer casts it here instead of into a
// buffer of its own, so filling costs no more than the casts it replaces.
// A chunk is served from here once cast; a chunk off the grid (the ends of
// a ranged or resumed stream) once every chunk it touches is, with the CRC
// of its own bytes. 8-bit float tensors are not kept: their chunks carry
// block scales cut to each chunk's ends, and they are cast as before.
//
// Correct across publishes: a Layer holds one version, and serves only
// streams of that version. A stream of a newer version replaces it (the
// old one goes when the last stream sending it is done); a stream of an
// older one (a pinned read) casts as before. A read-only shard's version
// numbers name one set of values for its life.
//
// Bounded: at most `capacity_bytes` held; a layer is taken only whole and
// only when the budget grants it with no stream waiting and as much room
// again left beside it (Admits), never by evicting another layer (a walk
// through a model larger than the cache would evict each layer before it is
// read again): a layer that does not fit is cast as before. Everything is
// dropped when a stream has to wait for budget (DropAll, the budget's
// reclaimer).
//
// Thread-safe. Lock order: this, then the budget. A Layer's chunks are
// claimed, filled and found without a lock.
class CastCache {
 public:
  class Layer;

  struct Options {
    uint64_t capacity_bytes = 0;  // --cast-cache-bytes
    uint64_t chunk_bytes = 0;     // the resolved --chunk-bytes: the grid
    uint32_t shard_index = 0;
    uint32_t num_shards = 1;
  };

  // `layouts` (every layer's, in the policy's dtypes), `budget` and
  // `metrics` must outlive the cache and every Layer it made.
  CastCache(Options options, absl::Span<const AssembledLayout> layouts, MemoryBudget& budget,
            ServerMetrics& metrics);
  ~CastCache();
  CastCache(const CastCache&) = delete;
  CastCache& operator=(const CastCache&) = delete;

  // Layer `layer` at `version` for a stream that sends that version: the
  // one held, or a new, empty one when it fits (replacing an older version
  // of the layer). Null when none: the layer is held at a newer version,
  // keeps nothing (8-bit floats, or none of it is this shard's), or does
  // not fit.
  std::shared_ptr<Layer> ForVersion(uint32_t layer, uint64_t version);

  // Drops layer `layer` (a worker saw one of its chunks fail a checksum).
  void DropLayer(uint32_t layer);
  // Drops every layer (a stream waits for budget).
  void DropAll();

  uint64_t held_bytes() const;
  size_t held_layers() const;

  // What a layer takes here: its tensors' owned elements in their compute
  // dtype, 8-bit float tensors left out.
  static uint64_t LayerBytes(const AssembledLayout& layout, uint32_t shard_index,
                             uint32_t num_shards);
  // Whether a layer of `bytes` is taken beside `held` bytes: within
  // `capacity`, and with a budget, in room that leaves as much again free
  // beside it after the `in_use` bytes (streams still find memory).
  static bool Admits(uint64_t held, uint64_t bytes, uint64_t capacity,
                     std::optional<uint64_t> budget, uint64_t in_use);

 private:
  // Removes `layer`'s entry; returns it, to be let go after the lock.
  std::shared_ptr<Layer> TakeLocked(uint32_t layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const absl::Span<const AssembledLayout> layouts_;
  MemoryBudget& budget_;
  ServerMetrics& metrics_;
  const std::vector<uint64_t> layer_bytes_;

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<Layer>> layers_ ABSL_GUARDED_BY(mu_);  // by layer; null: none
  uint64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t held_layers_ ABSL_GUARDED_BY(mu_) = 0;
};

// One layer at one version, its chunks filled as streams cast them. Charged
// to the budget from when the cache made it until the last holder (the
// cache, a stream, a slice in gRPC) lets it go. Thread-safe.
class CastCache::Layer : public std::enable_shared_from_this<Layer> {
 public:
  // Use CastCache::ForVersion. `bytes` are charged to `budget` already.
  Layer(uint32_t layer, const AssembledLayout& layout, const Options& options, uint64_t version,
        uint64_t bytes, MemoryBudget& budget);
  ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  uint64_t version() const { return version_; }
  uint64_t bytes() const { return bytes_; }

  // Chunk `key` (whole, at version(), in its tensor's compute dtype) as a
  // slice of the kept bytes, when every grid chunk it touches is filled.
  std::optional<CastChunk> Find(const ChunkKey& key) const;
  // Where to cast chunk `key` when it is one whole chunk of the grid that
  // nobody filled or claimed yet: the caller then casts it there and calls
  // Fill (or Abandon, when the cast failed). Null otherwise: cast it
  // elsewhere.
  uint8_t* Claim(const ChunkKey& key);
  // The claimed chunk `key` was cast, with CRC-32C `crc32c`: it is served
  // from here from now on. Returns it as a slice.
  CastChunk Fill(const ChunkKey& key, uint32_t crc32c);
  // The claimed chunk's cast failed: another stream may claim it again.
  void Abandon(const ChunkKey& key);

 private:
  enum CellState : uint8_t { kEmpty = 0, kFilling = 1, kFilled = 2 };
  struct Tensor {
    bool kept = false;  // not an 8-bit float, and the shard owns some
    DType dtype = DType::kFloat32;
    ElementRange owned;
    uint64_t per_chunk = 1;   // the grid's step, elements
    uint64_t offset = 0;      // of its first owned element in data_
    uint64_t first_cell = 0;  // of its first grid chunk in cells_
  };
  // The tensor of `key` when the key is one this layer can hold: whole, of
  // its layer, version and dtype, within the tensor's owned elements.
  const Tensor* TensorOf(const ChunkKey& key) const;
  grpc::Slice SliceOf(uint64_t offset, uint64_t size) const;

  const uint32_t layer_;
  const uint64_t version_;
  const uint64_t bytes_;
  MemoryBudget& budget_;
  std::vector<Tensor> tensors_;
  std::unique_ptr<uint8_t[]> data_;
  std::unique_ptr<std::atomic<uint8_t>[]> cells_;  // CellState of each grid chunk
  std::unique_ptr<uint32_t[]> crcs_;               // each filled chunk's CRC-32C
};

}  // namespace layercast::server
