#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/admin.pb.h"
#include "server/change_log.h"
#include "server/deadline_timers.h"
#include "server/memory_budget.h"
#include "server/parameter_store.h"
#include "server/pinned_versions.h"
#include "server/server_metrics.h"
#include "server/version_gate.h"

namespace layercast::server {

// The shard's side of publishing (admin.proto: BeginPublish, StagePublish,
// CommitPublish, AbortPublish): at most one publish open at a time, its new
// values staged in fp32 beside the master, charged to the budget, until a
// commit copies them into the master layer by layer or an abort (or the
// publish's timeout) drops them. Nothing a publish stages is visible before
// its commit, so a publisher that fails before committing everywhere
// leaves every shard at the base version.
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
  };
  // Everything linked must outlive this.
  explicit Publications(Links links);
  // Returns the staging of a publish still open.
  ~Publications();

  // Opens publish `request.publish_id()`; returns its staging bytes. Again
  // for the publish already open: the same answer, nothing changed.
  //   ABORTED              another publish is open (naming it);
  //   FAILED_PRECONDITION  a layer is not at base_version;
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
  // for a publish neither open nor the last committed.
  absl::StatusOr<Committed> Commit(const std::string& publish_id);
  // Runs `fn` while no publish commits (a commit, and staging, wait for it):
  // a checkpoint of a read-only shard is written under it, so that the file
  // holds the master of one version, the one read inside.
  void WithoutCommits(absl::FunctionRef<void()> fn);

  // Drops publish `publish_id` if it is open.
  void Abort(const std::string& publish_id, const std::string& why = "aborted by the publisher");

 private:
  struct Open {
    std::string id;
    uint64_t base_version = 0;
    std::vector<bool> selected;                           // per layer
    std::vector<std::vector<std::vector<float>>> staged;  // [layer][tensor], owned elements
    std::vector<std::vector<uint64_t>> next;              // [layer][tensor]: next element due
    uint64_t staging_bytes = 0;
    std::chrono::steady_clock::time_point begun;
    DeadlineTimers::Handle timer;
  };
  absl::StatusOr<Committed> CommitLocked(Open& open) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Links links_;
  absl::Mutex mu_;
  std::optional<Open> open_ ABSL_GUARDED_BY(mu_);
  std::optional<std::pair<std::string, Committed>> last_committed_ ABSL_GUARDED_BY(mu_);
  DeadlineTimers timers_;  // last: see DeadlineTimers
};

}  // namespace layercast::server
