#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client_defaults.h"
#include "client/shard_set.h"
#include "wire/gradient_chunks.h"

namespace layercast::client {

struct PublishOptions {
  // The shards' admin token (--admin-token-file), sent as a bearer token;
  // surrounding whitespace is trimmed (CleanBearerToken).
  std::string admin_token;
  // Send the token even though the shard set is connected without TLS
  // (loopback testing only); otherwise Publish refuses, sending nothing.
  bool insecure = false;
  // The whole publish ends by then; the shards abort it by themselves if
  // it is not committed by then (a publisher that died).
  std::chrono::milliseconds timeout = kPublishTimeout;
  // Value bytes per PublishChunk.
  uint64_t chunk_bytes = wire::kWriteChunkBytes;
};

struct PublishResult {
  // Every layer's version now.
  uint64_t version = 0;
  // Elements whose compute-dtype value changed, over all shards.
  uint64_t changed_elements = 0;
  // The shards had no room to stage the whole publish at once, so it was
  // published one layer at a time: each layer was atomic across the
  // shards, the whole was not, and it took `versions` versions.
  bool layer_by_layer = false;
  uint64_t versions = 1;
};

// New values of whole tensors, by name, in fp32 (a trainer's own master).
using TensorValues = std::map<std::string, std::span<const float>>;

// Publishes new weights from a trainer that keeps its own optimizer to a
// shard set, in two phases (admin.proto): begin on every shard, stream each
// shard the values it owns, and commit only once all have staged
// everything: on shard 0 first, whose commit decides the publish, then on
// the rest. A failure before shard 0's commit aborts the publish on every
// shard, and every shard goes on serving the version before. After it, the
// publish is rolled forward: a shard that restarted and lost what it
// staged is staged again, and commits are idempotent and retried until the
// timeout. With --peers, shard 0 hands its commit on to the others itself,
// so a publisher that dies after it leaves no shard behind
// (docs/recovery.md).
//
// Thread-compatible: one Publish at a time.
class WeightPublisher {
 public:
  // `shards` must outlive the publisher.
  WeightPublisher(const ShardSet& shards, PublishOptions options);

  // Publishes `values` as the next version of every layer: the layers
  // whose tensors `values` names are replaced, each whole (every tensor of
  // such a layer must be given, with its number of elements), the others
  // keep their values. INVALID_ARGUMENT, changing nothing, for an unknown
  // name, a wrong size or a layer given in part. `base_version`: the
  // version the values replace (FAILED_PRECONDITION on a shard at another);
  // by default the one the shards serve now, or, when one is behind the
  // others, the newest: a publish of every layer brings it level
  // (FAILED_PRECONDITION for one of some layers). INVALID_ARGUMENT, before
  // anything is sent, for a token no header can carry or a token over
  // plaintext without `insecure`.
  absl::StatusOr<PublishResult> Publish(const TensorValues& values,
                                        std::optional<uint64_t> base_version = std::nullopt);

 private:
  // One two-phase publish of `layers` from `base_version`.
  absl::StatusOr<PublishResult> PublishLayers(const TensorValues& values,
                                              const std::vector<uint32_t>& layers,
                                              uint64_t base_version,
                                              std::chrono::steady_clock::time_point deadline);
  // Begin and stage everything on shard `shard`.
  absl::Status StageOnShard(uint32_t shard, const std::string& id, const TensorValues& values,
                            const std::vector<uint32_t>& layers, uint64_t base_version,
                            std::chrono::steady_clock::time_point deadline);
  // The version each shard serves now, in shard order.
  absl::StatusOr<std::vector<uint64_t>> ShardVersions(
      std::chrono::steady_clock::time_point deadline) const;
  // Commits on shard `shard`, retrying while it does not answer.
  absl::Status CommitOnShard(uint32_t shard, const std::string& id,
                             std::chrono::steady_clock::time_point deadline,
                             uint64_t* changed) const;
  // Best effort; a shard not told settles it by itself.
  void AbortEverywhere(const std::string& id) const;
  // "version V" the shards serve now, for messages.
  std::string ServedNow() const;

  const ShardSet& shards_;
  const PublishOptions options_;
  // options_.admin_token as sent: checked and trimmed by Publish.
  std::string token_;
};

}  // namespace layercast::client
