#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "core/layout.h"
#include "layercast/v1/shard.pb.h"
#include "relay/relayed_versions.h"
#include "server/serving/chunk_source.h"

namespace layercast::relay {

// A relay's chunks for one FetchLayer stream: the bytes its mirror pulled
// (the shards' casts, never cast again), cut on the shard's own chunk grid.
// A full chunk of a 16- or 32-bit dtype goes out as a slice of the held
// version itself, not a copy; a delta chunk is encoded once, straight into
// the slice that goes on the wire.
class RelayChunks final : public server::ChunkSource {
 public:
  // `versions`, `layout` (the layer as the relay holds it) and `context`
  // must outlive this. `request` is the stream's; `sent` counts the bytes
  // of the chunks it sent.
  RelayChunks(const RelayedVersions& versions, const AssembledLayout& layout, uint32_t shard,
              uint32_t num_shards, const layercast::v1::FetchLayerRequest& request,
              grpc::CallbackServerContext* context, std::shared_ptr<std::atomic<uint64_t>> sent);

  // The version held: the newest (or the pinned one), with the base of a
  // delta checked against it; names the incarnation of the shard that cast
  // it on the stream, so the reader's next delta goes on from the shards.
  absl::StatusOr<uint64_t> Start(uint64_t reached) override;
  ElementRange Owned(uint32_t tensor) const override;
  std::optional<absl::StatusOr<server::CastChunk>> Get(const server::ChunkKey& key, uint64_t bytes,
                                                       Resume resume) override;
  // A death mid-delta (the failpoint relay.mid_delta): a chunk sent, the
  // rest not.
  void Sent() override;
  uint32_t shard_index() const override { return shard_; }
  std::string WaitingFor() const override;

 private:
  // OUT_OF_RANGE when the delta to target_ of this shard's slice would be
  // larger than its values (most of them changed), as the shards answer:
  // the reader pulls in full, which costs less.
  absl::Status DeltaPays() const;
  absl::StatusOr<server::CastChunk> Full(const server::ChunkKey& key,
                                         const AssembledTensor& placed) const;
  absl::StatusOr<server::CastChunk> Delta(const server::ChunkKey& key,
                                          const AssembledTensor& placed) const;

  const RelayedVersions& versions_;
  const AssembledLayout& layout_;
  const uint32_t shard_;
  const uint32_t num_shards_;
  const uint32_t layer_;
  const std::optional<uint64_t> exact_version_;
  const std::optional<uint64_t> base_version_;
  const std::optional<uint64_t> base_incarnation_;
  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<std::atomic<uint64_t>> sent_;
  uint64_t pending_bytes_ = 0;  // of the chunk Get gave last
  // Set by Start: what the stream sends, and a delta's changes.
  HeldLayer target_;
  std::shared_ptr<const ChangedElements> changed_;
};

}  // namespace layercast::relay
