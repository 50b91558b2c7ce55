#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/shard.pb.h"
#include "server/serving/change_log.h"
#include "server/serving/deadline_timers.h"
#include "server/serving/fetch_plan.h"
#include "server/serving/parameter_store.h"
#include "server/serving/server_metrics.h"
#include "server/serving/version_gate.h"
#include "server/versions/pinned_versions.h"
#include "wire/slice_digest.h"

namespace layercast::server {

// The digests a shard gives of what it serves (GetLayerDigest): the
// SHA-256 of its slice of a layer at one version and dtype
// (wire/slice_digest.h), cast chunk by chunk on the stream's own grid, from
// the master or the version PinnedVersions kept, exactly as a FetchLayer
// stream casts it, so a reader can check bytes a relay carried. Each is
// computed once, when first asked for, on the shard's background thread
// (each chunk takes the layer's lock shared, as a stream's chunk does: an
// optimizer step waits for one chunk's cast at most, never for the
// digest), and the newest kCached are kept for the readers after.
//
// Thread-safe. The destructor waits for the digest being computed.
class LayerDigests {
 public:
  struct Links {
    const ParameterStore* store = nullptr;
    const VersionGate* gate = nullptr;
    const ChangeLog* changes = nullptr;  // null: --delta-versions 0
    PinnedVersions* pinned = nullptr;    // null: no versions kept
    ServerMetrics* metrics = nullptr;
    uint64_t chunk_bytes = 0;  // the resolved --chunk-bytes
    // Set when the shard drains: a digest in progress or queued stops with
    // UNAVAILABLE instead of holding the shutdown for a pass over a slice.
    const std::atomic<bool>* stopping = nullptr;
    // The shard's background thread, which must outlive this; null: a
    // thread of its own.
    DeadlineTimers* background = nullptr;
  };
  static constexpr size_t kCached = 256;

  // Everything linked must outlive this.
  explicit LayerDigests(Links links);
  ~LayerDigests();

  // Calls `done` once with the digest (at once when kept, else from the
  // digest thread), or with the refusal: PlanFetch's for a bad layer or
  // dtype; OUT_OF_RANGE for a version the layer has not reached; ABORTED,
  // naming the version it is at, for one it no longer keeps.
  using Done = std::function<void(absl::StatusOr<layercast::v1::LayerDigest>)>;
  void Get(const layercast::v1::GetLayerDigestRequest& request, Done done);

 private:
  struct Key {
    uint32_t layer = 0;
    uint64_t version = 0;
    int dtype = 0;
    friend bool operator==(const Key&, const Key&) = default;
  };
  absl::StatusOr<wire::SliceDigest::Sha256> Compute(const FetchPlan& plan, uint64_t version) const;
  // What a chunk of `layer` at `version` is cast from: the master (null) or
  // the version kept. REQUIRES: the layer's mutex held shared.
  absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> SourceOf(uint32_t layer,
                                                                       uint64_t version,
                                                                       bool kept_bits_serve) const;
  layercast::v1::LayerDigest Answer(const Key& key, const wire::SliceDigest::Sha256& sha) const;
  std::optional<wire::SliceDigest::Sha256> Cached(const Key& key) const;

  const Links links_;
  mutable absl::Mutex mu_;
  std::deque<std::pair<Key, wire::SliceDigest::Sha256>> cached_
      ABSL_GUARDED_BY(mu_);  // newest last
  // Last: see DeadlineTimers. The gRPC server stops first and waits for
  // every call, so no digest is dropped while queued.
  DeadlineTimers work_;
};

}  // namespace layercast::server
