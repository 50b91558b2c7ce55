#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/admin.pb.h"
#include "server/publishing/publish_peers.h"
#include "server/serving/change_log.h"
#include "server/serving/deadline_timers.h"
#include "server/serving/memory_budget.h"
#include "server/serving/parameter_store.h"
#include "server/serving/server_metrics.h"
#include "server/serving/version_gate.h"
#include "server/versions/pinned_versions.h"
#include "server/versions/versioned_master.h"

namespace layercast::server {

// The shard's side of publishing (admin.proto: BeginPublish, StagePublish,
// CommitPublish, AbortPublish): at most one publish open at a time, its new
// values staged in fp32 beside the master, charged to the budget, until a
// commit copies them into the master layer by layer or an abort (or the
// publish's timeout) drops them. Nothing a publish stages is visible before
// its commit, so a publisher that fails before committing everywhere
// leaves every shard at the base version.
//
// With peers (--peers), the set settles a publish whose publisher stopped
// (PublishPeers): shard 0's commit decides and is handed on, and a shard
// asks the set before it drops what it staged. A publish whose base is the
// set's version and that replaces every layer also brings a shard that is
// behind (one restarted without its checkpoint) to the new version.
//
// A commit holds each layer's ParameterStore::layer_mutex exclusively while
// it copies the layer's values in, records what changed (ChangeLog) and
// advances the layer in the VersionGate, as an optimizer step does: a
// reader sees a layer's master and version agree.
//
// Thread-safe.
class Publications {
 public:
  struct Links {
    ParameterStore* store = nullptr;
    VersionGate* gate = nullptr;
    MemoryBudget* budget = nullptr;
    ChangeLog* changes = nullptr;  // null: --delta-versions 0
    ServerMetrics* metrics = nullptr;
    PinnedVersions* pinned = nullptr;  // null: --pin-retention-ms 0 or no change log
    // What the publish timeout and the idle window are read on; null: the
    // steady clock.
    platform::Clock* clock = nullptr;
    // The shard's background thread (its clock, not `clock`, then); null:
    // a thread of its own.
    DeadlineTimers* background = nullptr;
  };
  struct SetOptions {
    std::unique_ptr<PublishPeers> peers;  // null: no --peers, settle alone
    // --publish-idle-ms: an open publish idle this long counts as stopped
    // when another begins.
    std::chrono::milliseconds idle{3000};
  };
  // Everything linked must outlive this.
  explicit Publications(Links links);
  Publications(Links links, SetOptions set);
  // Returns the staging of a publish still open.
  ~Publications();

  // Opens publish `request.publish_id()`; returns its staging bytes. Again
  // for the publish already open: the same answer, nothing changed.
  //   ABORTED              another publish is open (naming it), without
  //                        peers; or this one was aborted here;
  //   UNAVAILABLE          with peers, another publish is open: it is
  //                        settled once idle, so begin again shortly;
  //   FAILED_PRECONDITION  a layer is not at base_version (a layer behind it
  //                        is accepted when the publish replaces every layer);
  //   INVALID_ARGUMENT     no id, or a layer out of range;
  //   RESOURCE_EXHAUSTED   the staging does not fit the budget's room now.
  absl::StatusOr<uint64_t> Begin(const layercast::v1::BeginPublishRequest& request);
  // Stages one chunk. NOT_FOUND when `chunk`'s publish is not open (never
  // begun, committed, aborted or timed out); INVALID_ARGUMENT for a layer
  // outside the publish, elements this shard does not own or out of order,
  // a wrong dtype; DATA_LOSS for a CRC-32C that does not match.
  absl::Status Stage(const layercast::v1::PublishChunk& chunk);

  struct Committed {
    uint64_t version = 0;
    uint64_t changed_elements = 0;
  };
  // FAILED_PRECONDITION naming the first tensor not staged whole; NOT_FOUND
  // for a publish neither open nor recently committed; ABORTED for one
  // aborted here (shard 0 never commits a publish it fenced).
  absl::StatusOr<Committed> Commit(const std::string& publish_id);
  // Runs `fn` while no publish commits (a commit, and staging, wait for it):
  // a checkpoint of a read-only shard is written under it, so that the file
  // holds the master of one version, the one read inside.
  void WithoutCommits(absl::FunctionRef<void()> fn);

  // Drops publish `publish_id` if it is open.
  void Abort(const std::string& publish_id, const std::string& why = "aborted by the publisher");

  // What this shard knows of publish `publish_id` (ShardAdmin.ResolvePublish);
  // with `fence` on shard 0, aborts it for good unless committed.
  layercast::v1::ResolvePublishResponse Resolve(const std::string& publish_id, bool fence);

 private:
  struct Open {
    std::string id;
    uint64_t base_version = 0;
    std::vector<bool> selected;                           // per layer
    std::vector<std::vector<std::vector<float>>> staged;  // [layer][tensor], owned elements
    std::vector<std::vector<uint64_t>> next;              // [layer][tensor]: next element due
    uint64_t staging_bytes = 0;
    // Some layer was below base_version: this commit brings the shard level.
    bool levels = false;
    std::chrono::steady_clock::time_point begun;
    std::chrono::steady_clock::time_point last_call;  // Begin or Stage
    bool settling = false;                            // PublishPeers::Settle is asking the set
    DeadlineTimers::Handle timer;
  };
  // How a publish ended here, kept for the last kDecisionsKept publishes:
  // commits answer again, and an aborted one is never committed.
  struct Decision {
    std::string id;
    std::optional<Committed> committed;  // nullopt: aborted
    // Aborted as the set decided (shard 0's decision, here or heard from
    // the set), not by this shard alone: ResolvePublishResponse.set_decision.
    bool by_set = false;
  };
  static constexpr size_t kDecisionsKept = 64;

  // Commits the open publish and records it; the caller checked the id.
  absl::StatusOr<Committed> CommitOpen(absl::string_view outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Committed> CommitLocked(Open& open) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the open publish and records it aborted.
  void AbortOpen(const std::string& why, absl::string_view outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Decision* Decided(const std::string& id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void Remember(Decision decision) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The open publish's publisher looks gone (idle, or past its timeout):
  // shard 0 aborts it; another shard asks the set.
  void SettleOpen(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PublishPeers' answer for publish `id`.
  void Settled(const std::string& id, std::optional<bool> committed);

  const Links links_;
  VersionedMaster master_;  // how a commit changes each layer
  const std::chrono::milliseconds idle_;
  absl::Mutex mu_;
  std::optional<Open> open_ ABSL_GUARDED_BY(mu_);
  std::deque<Decision> decided_ ABSL_GUARDED_BY(mu_);  // oldest first
  // After mu_ and open_: its calls settle into them until it goes (its
  // calls_ waits for the call under way and drops the rest).
  std::unique_ptr<PublishPeers> peers_;
  // Last: see DeadlineTimers. The shard's background thread, not its timer
  // thread: a publish's timeout takes mu_, which a commit or a checkpoint
  // holds for long.
  DeadlineTimers timers_;
};

}  // namespace layercast::server
