#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/layer_source.h"
#include "client/shard_stream.h"
#include "core/layout.h"
#include "platform/retry.h"

namespace layercast::client {

// One gather of one layer (or byte range of it) from every shard at once. A
// shard whose stream fails with UNAVAILABLE (it died, restarted, is draining
// or still loading), DATA_LOSS (a chunk failed its checksum) or a CANCELLED
// the gather did not ask for (the shard's own shutdown) is retried by
// platform::kGatherStream, with exponential backoff and jitter until the
// gather's deadline (GatherOptions::timeout), resuming from the first
// element it has not delivered intact rather than from the start; a rolling
// restart of a shard is waited out. A stream is settled by what it
// delivered, not by how it ended: one that failed after its last chunk is
// done. Any other failure, or running out of time, cancels every stream and
// fails the gather with the shard's error, naming it. A shard that comes
// back as another incarnation (it restarted: its number may name other
// values now) is read again from the start of its slice, never resumed; a
// delta then fails OUT_OF_RANGE. With GatherOptions::pinned_identity, a
// shard of another incarnation than the walk's fails the gather with
// ABORTED.
//
// Single use: construct, Run() once. Not thread-safe; Run() blocks.
class LayerGather {
 public:
  struct Shard {
    grpc::GenericStub* stub;
    std::string describe;  // "shard 1 (host:port)"
    // The shard's manifest content_fingerprint, sent in every request: a
    // shard restarted with other values refuses instead of being mixed in.
    std::string content_fingerprint;
  };

  // Everything referenced must outlive Run(). `default_version` is returned
  // when no shard had anything to send (a range of padding only).
  LayerGather(std::vector<Shard> shards, const AssembledLayout& layout, uint32_t layer,
              const GatherOptions& options, std::span<uint8_t> buffer, uint64_t default_version);

  // The parameter version the layer was cast from.
  absl::StatusOr<uint64_t> Run();

  // The newest version any stream sent (0 if none): after Run() failed with
  // ABORTED because versions moved, the min_version to gather again with.
  uint64_t newest_version() const;
  // Shards whose whole slice was read again because they restarted
  // mid-gather (another incarnation resumed their stream).
  uint64_t rereads() const;
  // The newest minus the oldest version any stream sent; 0 before any.
  uint64_t version_skew() const;

 private:
  struct ShardState {
    std::vector<ShardStream::Run> runs;  // what this shard still owes
    std::unique_ptr<ShardStream> stream;
    int attempts = 0;
    platform::Backoff backoff{platform::kGatherStream};
    std::optional<std::chrono::steady_clock::time_point> retry_at;
    absl::Status last_error;
    // Of the shard's streams that delivered chunks; 0 before one did.
    uint64_t incarnation = 0;
  };

  // The runs shard `shard` owns within the requested range.
  std::vector<ShardStream::Run> OwnedRuns(uint32_t shard) const;
  // The request for a shard's first stream, or for resuming `runs` (the
  // tail of what it owes); `recast` asks the shard to cast afresh.
  layercast::v1::FetchLayerRequest RequestFor(uint32_t shard,
                                              const std::vector<ShardStream::Run>& runs,
                                              bool resume, bool recast) const;
  void Start(uint32_t shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Folds a finished stream into its shard's state: done, retry later, or
  // fail the gather.
  void Settle(uint32_t shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CancelAll() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Shard `shard` answered as `incarnation`, another than the one that sent
  // the earlier part of its slice: reads the whole slice again from it (a
  // full pull), or fails a delta (OUT_OF_RANGE); nothing when the gather is
  // failing or cancelled already.
  void ReadAgain(uint32_t shard, uint64_t incarnation, uint64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<Shard> shards_;
  const AssembledLayout& layout_;
  const uint32_t layer_;
  const GatherOptions& options_;
  const std::span<uint8_t> buffer_;
  const uint64_t default_version_;
  uint64_t range_begin_ = 0, range_end_ = 0;
  std::vector<TensorElementRange> selected_;
  std::chrono::system_clock::time_point deadline_;

  mutable absl::Mutex mu_;
  std::vector<ShardState> state_ ABSL_GUARDED_BY(mu_);
  std::deque<uint32_t> finished_ ABSL_GUARDED_BY(mu_);  // streams whose on_done ran
  uint32_t active_ ABSL_GUARDED_BY(mu_) = 0;            // streams started, not settled
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  // The version of the first chunks any stream delivered.
  std::optional<uint64_t> version_ ABSL_GUARDED_BY(mu_);
  // The newest version any stream sent.
  uint64_t newest_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t oldest_version_ ABSL_GUARDED_BY(mu_) = UINT64_MAX;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t rereads_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace layercast::client
