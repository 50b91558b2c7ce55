#pragma once

#include <atomic>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "server/access/auth_token.h"
#include "server/checkpoints/checkpoint_manager.h"
#include "server/publishing/publication.h"
#include "server/serving/deadline_timers.h"
#include "server/serving/parameter_store.h"
#include "server/serving/server_metrics.h"
#include "server/serving/version_gate.h"
#include "server/shard/loaded_shard.h"
#include "server/training/layer_trainer.h"

namespace layercast::server {

// The gRPC ShardAdmin service of one shard (proto/layercast/v1/admin.proto),
// on the callback API. Every call is authorised first: refused with
// FAILED_PRECONDITION when the shard has no admin token, UNAUTHENTICATED
// without a bearer token, PERMISSION_DENIED with a wrong one. Checkpoint
// writes run on the shard's background thread, never on gRPC's, one at a
// time. That thread also runs the periodic checkpoints, the digests and
// the publish timeouts one after another: a Checkpoint call while another
// write (asked for or periodic) is under way is refused with ABORTED at
// once, as admin.proto says, rather than queued; one that arrives while a
// digest or a publish timeout runs waits for it, and a GetLayerDigest or a
// publish timeout asked meanwhile waits for the write.
//
// Thread-safe: gRPC calls its handlers from many threads.
class ShardAdminService final : public layercast::v1::ShardAdmin::CallbackService {
 public:
  struct Options {
    // Null without --checkpoint-dir: Checkpoint is refused.
    CheckpointManager* checkpoints = nullptr;
    // Nullopt without --admin-token-file: every call is refused.
    std::optional<AdminToken> token;
  };

  // `checkpoints`, `gate`, `metrics` and `background` must outlive the
  // service. `background`: the shard's background thread; null: a thread
  // of its own.
  ShardAdminService(Options options, const VersionGate& gate, ServerMetrics& metrics,
                    DeadlineTimers* background = nullptr);
  // Waits for a checkpoint being written.
  ~ShardAdminService() override = default;

  // Makes the loaded shard available; called once. `shard` must outlive
  // every call. Without publications (a training shard) publishes are
  // refused.
  void AttachStore(LoadedShard& shard);
  // New calls are refused with UNAVAILABLE from now on.
  void StartDraining() { draining_.store(true); }

  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* context,
                                       const layercast::v1::CheckpointRequest* request,
                                       layercast::v1::CheckpointResponse* response) override;
  grpc::ServerUnaryReactor* BeginPublish(grpc::CallbackServerContext* context,
                                         const layercast::v1::BeginPublishRequest* request,
                                         layercast::v1::BeginPublishResponse* response) override;
  grpc::ServerReadReactor<layercast::v1::PublishChunk>* StagePublish(
      grpc::CallbackServerContext* context, layercast::v1::StagePublishResponse* response) override;
  grpc::ServerUnaryReactor* CommitPublish(grpc::CallbackServerContext* context,
                                          const layercast::v1::CommitPublishRequest* request,
                                          layercast::v1::CommitPublishResponse* response) override;
  grpc::ServerUnaryReactor* AbortPublish(grpc::CallbackServerContext* context,
                                         const layercast::v1::AbortPublishRequest* request,
                                         layercast::v1::AbortPublishResponse* response) override;
  grpc::ServerUnaryReactor* ResolvePublish(
      grpc::CallbackServerContext* context, const layercast::v1::ResolvePublishRequest* request,
      layercast::v1::ResolvePublishResponse* response) override;
  // Live hand-over (shard_admin_handover.cc).
  grpc::ServerUnaryReactor* HandOver(grpc::CallbackServerContext* context,
                                     const layercast::v1::HandOverRequest* request,
                                     layercast::v1::HandOverResponse* response) override;
  grpc::ServerUnaryReactor* Unfreeze(grpc::CallbackServerContext* context,
                                     const layercast::v1::UnfreezeRequest* request,
                                     layercast::v1::UnfreezeResponse* response) override;
  grpc::ServerUnaryReactor* ReadState(grpc::CallbackServerContext* context,
                                      const layercast::v1::ReadStateRequest* request,
                                      layercast::v1::ReadStateResponse* response) override;

 private:
  grpc::Status Authorize(const grpc::CallbackServerContext& context) const;
  grpc::ServerUnaryReactor* Finish(grpc::ServerUnaryReactor* reactor, const grpc::Status& status,
                                   absl::string_view method = "Checkpoint");
  // The publications of a loaded read-only shard, or why a publish call is
  // refused (authorisation, draining, loading, training).
  absl::StatusOr<Publications*> PublicationsFor(const grpc::CallbackServerContext& context);
  // The trainer of a loaded training shard, or why a hand-over call is
  // refused (authorisation, draining, loading, read-only).
  absl::StatusOr<LayerTrainer*> TrainerFor(const grpc::CallbackServerContext& context);

  const Options options_;
  const VersionGate& gate_;
  ServerMetrics& metrics_;
  std::atomic<bool> draining_{false};
  absl::Mutex mu_;
  const ParameterStore* store_ ABSL_GUARDED_BY(mu_) = nullptr;
  LayerTrainer* trainer_ ABSL_GUARDED_BY(mu_) = nullptr;  // null: read-only
  Publications* publications_ ABSL_GUARDED_BY(mu_) = nullptr;
  // A training shard's --checkpoint-every; null without it.
  const PeriodicCheckpoints* periodic_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  // Last: see DeadlineTimers. Where a call's checkpoint is written. The
  // gRPC server stops first and waits for the call, so a write is never
  // dropped while queued.
  DeadlineTimers writes_;
};

}  // namespace layercast::server
