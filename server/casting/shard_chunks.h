#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/casting/cast_cache.h"
#include "server/casting/cast_error_ledger.h"
#include "server/casting/chunk_caster.h"
#include "server/serving/change_log.h"
#include "server/serving/chunk_pool.h"
#include "server/serving/chunk_source.h"
#include "server/serving/fetch_plan.h"
#include "server/serving/parameter_store.h"
#include "server/serving/server_metrics.h"
#include "server/serving/shared_chunks.h"
#include "server/serving/version_gate.h"
#include "server/versions/pinned_versions.h"
#include "wire/delta_chunks.h"

namespace layercast::server {

// A shard's chunks for one FetchLayer stream: cast chunk by chunk straight
// from the fp32 master into the slice that goes on the wire (see
// EncodeLayerChunk), so no copy of the layer in its compute dtype ever
// exists beyond the chunks in flight, but for a version the layer has moved
// past: a pinned read (or a stream a change overtook) copies its chunks
// from the version PinnedVersions kept, which a cast at that version gave.
// A delta chunk is cast whole and packed to the elements ChangeLog says
// changed. Chunks another stream cast are shared through SharedChunks.
// On a shard with a cast cache, a full pull in the policy's dtypes sends
// what the cache holds of its version and casts the rest into it.
class ShardChunks final : public ChunkSource {
 public:
  struct Options {
    uint64_t chunk_bytes = 0;  // the resolved --chunk-bytes
    // Where chunks cast by other streams are shared; null: cast every chunk
    // here.
    SharedChunks* shared = nullptr;
    // The buffers chunks are cast into; null: a std::malloc block each.
    ChunkPool* pool = nullptr;
    // A read-only shard's cast cache (--cast-cache-bytes); null: off. Used
    // by full pulls in the policy's dtypes; a recast drops the layer's.
    CastCache* cache = nullptr;
    // A delta pull from this version (FetchLayerRequest.base_version): what
    // changed since is read from `changes`, which must be set with it.
    std::optional<uint64_t> base_version;
    const ChangeLog* changes = nullptr;
    // A pinned read (FetchLayerRequest.exact_version): the stream sends
    // this version; set `changes` with it.
    std::optional<uint64_t> exact_version;
    // FetchLayerRequest.will_pull_deltas: tells `changes` (ChangeLog::
    // NoteAsked), as a delta pull or a pinned read does.
    bool will_pull_deltas = false;
    // Where versions a change superseded are kept: a stream at a version its
    // layer has moved past (pinned, or overtaken mid-layer) sends from
    // there; a pinned read leases its version there. Null: such a stream
    // ends with ABORTED.
    PinnedVersions* pinned = nullptr;
    // What each chunk's cast lost, measured once per chunk and version.
    // Null: measured, and counted in the metrics, on every cast.
    CastErrorLedger* cast_errors = nullptr;
    uint32_t cast_error_sample_every = 0;  // as ChunkCaster::Options' (0: 1)
    // The worker's last stream of this layer failed a checksum
    // (FetchLayerRequest.recast): the stream trusts no kept CRC, checksums
    // every chunk it casts, and puts that CRC in `cast_errors` in place of
    // a kept one that differs (which may be what failed).
    bool recast = false;
    // What the layer's next version waits for (TrainerLayers::WaitingFor).
    // Empty: nothing to add.
    std::function<std::string(uint32_t layer)> waiting_for;
  };

  // Everything referenced must outlive this.
  ShardChunks(const ParameterStore& store, const VersionGate& gate, ServerMetrics& metrics,
              FetchPlan plan, Options options);
  ~ShardChunks() override;

  absl::StatusOr<uint64_t> Start(uint64_t reached) override;
  ElementRange Owned(uint32_t tensor) const override { return store_.owned(plan_.layer, tensor); }
  std::optional<absl::StatusOr<CastChunk>> Get(const ChunkKey& key, uint64_t bytes,
                                               Resume resume) override;
  uint32_t shard_index() const override { return store_.shard_index(); }
  std::string WaitingFor() const override;

 private:
  // Casts chunk `key` from the master into a new slice (the cast cache's,
  // when it takes the chunk), with its CRC-32C, or (a delta key) into the
  // delta chunk of its span.
  absl::StatusOr<CastChunk> Cast(const ChunkKey& key);
  // What the cast cache holds of the stream's layer at key.version (looked
  // up at the stream's first chunk): null when the stream does not use it
  // or the cache does not hold the layer.
  CastCache::Layer* CachedLayer(const ChunkKey& key);
  absl::StatusOr<CastChunk> CastDelta(const ChunkKey& key);
  // A delta chunk of an 8-bit float tensor, from the span's codes and
  // scales at key.version (`quantized`) and the fp32 elements that changed
  // since the base (`changed`, rewritten to the codes that changed).
  absl::StatusOr<CastChunk> CastFp8Delta(const ChunkKey& key, const AssembledTensor& placed,
                                         const wire::DeltaSpan& span,
                                         std::span<const uint8_t> quantized,
                                         std::vector<uint64_t>& changed);
  // Where key.version's values are: null for the master (the layer is at
  // that version, or changed nothing since), else the version kept of it;
  // ABORTED when neither. REQUIRES: the layer's mutex held shared.
  absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> SourceOf(const ChunkKey& key);
  // What an 8-bit float delta quantizes its base again from: null for the
  // master (nothing changed since the base), else the fp32 PinnedVersions
  // kept of it; OUT_OF_RANGE when that is gone. REQUIRES: the layer's
  // mutex held shared.
  absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> BaseOf(const ChunkKey& key);
  // For a pinned read whose layer is at `current`: holds the kept version
  // it asks for (held_) for the stream's life, so a reclaim while it waits
  // for budget cannot take it away; ABORTED, naming the version to walk
  // again at, when the shard has no such version. Takes the layer's mutex.
  absl::Status HoldExactVersion(uint64_t current);
  // Leases the pinned version (PinnedVersions::Lease) for a read it serves.
  void LeaseExactVersion();
  // ABORTED for a stream in a dtype of its own at `version`, which its
  // layer (now at `current`) has left.
  absl::Status NotInThisDType(uint64_t version, uint64_t current) const;
  // Why a superseded version is not at hand, for messages.
  std::string WhyNotKept() const;
  // OUT_OF_RANGE when a delta from `base` to `target` of what the stream
  // sends would be larger than the values themselves (most of them
  // changed): the reader pulls in full, which costs less.
  absl::Status DeltaPays(uint64_t base, uint64_t target) const;

  const ParameterStore& store_;
  const VersionGate& gate_;
  ServerMetrics& metrics_;
  const FetchPlan plan_;  // the stream's (its reactor keeps its own)
  const Options options_;
  const ChunkCaster caster_;
  // Counted in pinned_readers (it sent from a version its layer had left).
  std::atomic<bool> pinned_{false};
  // The kept version a pinned read sends from; set by Start.
  std::shared_ptr<const PinnedVersions::Kept> held_;
  // The cast cache, when this stream reads through it; the layer it holds
  // of the stream's version, once looked up.
  CastCache* const cache_;
  bool cache_looked_up_ = false;
  std::shared_ptr<CastCache::Layer> cached_;
};

}  // namespace layercast::server
