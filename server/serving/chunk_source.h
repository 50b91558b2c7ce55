#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "core/layout.h"
#include "server/serving/shared_chunks.h"

namespace layercast::server {

// Where the chunks of one FetchLayer stream come from, once the stream has
// waited for its version and its budget (FetchLayerReactor does both, the
// same on a shard and on a relay): a shard casts them from its fp32 master
// or a version it kept (ShardChunks); a relay sends the bytes its mirror
// pulled (relay/relay_chunks.h). One source per stream; the reactor calls
// it from one step at a time, never two at once.
class ChunkSource {
 public:
  // Resumes a stream whose chunk another stream is still making.
  using Resume = std::function<void(absl::StatusOr<CastChunk>)>;

  virtual ~ChunkSource() = default;

  // The layer reached `reached` (the version it waited for, or past it):
  // the version the stream sends, or why it cannot (the version asked for
  // is gone, a delta's base is not held...), with what the reader should do.
  virtual absl::StatusOr<uint64_t> Start(uint64_t reached) = 0;

  // The slice of `tensor` (of the stream's layer) the source's chunk grid
  // is cut on: its shard's.
  virtual ElementRange Owned(uint32_t tensor) const = 0;

  // Chunk `key` (key.version is what Start gave): at once, or nullopt when
  // `resume` will be posted with it (another stream is making it).
  virtual std::optional<absl::StatusOr<CastChunk>> Get(const ChunkKey& key, uint64_t bytes,
                                                       Resume resume) = 0;

  // The chunk Get gave last reached the reader's transport.
  virtual void Sent() {}

  // The shard whose slice the stream sends, for the failpoints.
  virtual uint32_t shard_index() const = 0;
  // A sentence for a stream that gave up waiting for a version: what the
  // layer's next version waits for. Empty: nothing to add.
  virtual std::string WaitingFor() const { return {}; }
};

}  // namespace layercast::server
