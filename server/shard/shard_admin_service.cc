#include "server/shard/shard_admin_service.h"

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "platform/log.h"
#include "server/access/call_authorization.h"
#include "server/serving/refusals.h"
#include "server/shard/shard_checkpoint.h"
#include "wire/grpc_status.h"

namespace layercast::server {

ShardAdminService::ShardAdminService(Options options, const VersionGate& gate,
                                     ServerMetrics& metrics, DeadlineTimers* background)
    : options_(std::move(options)), gate_(gate), metrics_(metrics), writes_(background) {}

void ShardAdminService::AttachStore(LoadedShard& shard) {
  absl::MutexLock lock(&mu_);
  store_ = shard.store.get();
  trainer_ = shard.trainer.get();
  publications_ = shard.publications.get();
  periodic_ = shard.periodic_checkpoints.get();
}

grpc::Status ShardAdminService::Authorize(const grpc::CallbackServerContext& context) const {
  if (!options_.token) {
    return wire::ToGrpcStatus(absl::FailedPreconditionError(
        "this shard has no admin token, so it refuses every ShardAdmin call: "
        "start it with --admin-token-file FILE (see docs/security.md)"));
  }
  const std::optional<std::string> authorization = AuthorizationOf(context);
  return wire::ToGrpcStatus(options_.token->Check(authorization ? &*authorization : nullptr));
}

grpc::ServerUnaryReactor* ShardAdminService::Finish(grpc::ServerUnaryReactor* reactor,
                                                    const grpc::Status& status,
                                                    absl::string_view method) {
  metrics_.RecordRpc(method, wire::StatusCodeName(status.error_code()));
  reactor->Finish(status);
  return reactor;
}

grpc::ServerUnaryReactor* ShardAdminService::Checkpoint(
    grpc::CallbackServerContext* context, const layercast::v1::CheckpointRequest*,
    layercast::v1::CheckpointResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (grpc::Status authorized = Authorize(*context); !authorized.ok()) {
    return Finish(reactor, authorized);
  }
  if (options_.checkpoints == nullptr) {
    return Finish(reactor, wire::ToGrpcStatus(absl::FailedPreconditionError(
                               "this shard has no checkpoint directory: start it with "
                               "--checkpoint-dir DIR")));
  }
  if (draining_.load()) {
    return Finish(reactor, ShuttingDownRefusal("it writes its checkpoint on exit unless started "
                                               "with --checkpoint-on-sigterm false"));
  }
  absl::MutexLock lock(&mu_);
  if (store_ == nullptr) {
    return Finish(reactor, LoadingRefusal());
  }
  // A periodic write under way too: on the one background thread this call
  // would otherwise queue behind it, and its TryWrite would find none.
  if (writing_ || (periodic_ != nullptr && periodic_->writing())) {
    return Finish(reactor,
                  wire::ToGrpcStatus(absl::AbortedError(absl::StrCat(
                      "a checkpoint of this shard is being written to ",
                      options_.checkpoints->path(), "; wait for it to finish and retry"))));
  }
  writing_ = true;
  writes_.Post(
      [this, reactor, response, store = store_, trainer = trainer_, publications = publications_] {
        absl::StatusOr<CheckpointInfo> info =
            WriteShardCheckpoint(*options_.checkpoints, *store, trainer, publications, gate_, true);
        grpc::Status status;
        if (info.ok()) {
          response->set_path(info->path);
          response->set_bytes(info->bytes);
          response->set_version(info->version);
          response->set_seconds(info->seconds);
          response->set_shard_index(store->shard_index());
          response->set_num_shards(store->num_shards());
          response->set_checksum(info->checksum);
          Log()->info("checkpoint version {} written to {} in {:.2f} s", info->version, info->path,
                      info->seconds);
        } else {
          status = wire::ToGrpcStatus(info.status());
          Log()->error("{}", info.status().message());
        }
        {
          absl::MutexLock lock(&mu_);
          writing_ = false;
        }
        Finish(reactor, status);
      });
  return reactor;
}

absl::StatusOr<Publications*> ShardAdminService::PublicationsFor(
    const grpc::CallbackServerContext& context) {
  if (grpc::Status authorized = Authorize(context); !authorized.ok()) {
    return wire::FromGrpcStatus(authorized);
  }
  if (draining_.load()) {
    return absl::UnavailableError(ShuttingDownMessage(
        "it takes no publish calls; an open publish is not committed: abort it everywhere and "
        "publish again to the shard's replacement"));
  }
  absl::MutexLock lock(&mu_);
  if (store_ == nullptr) {
    return absl::UnavailableError(kLoadingMessage);
  }
  if (trainer_ != nullptr || publications_ == nullptr) {
    return absl::FailedPreconditionError(
        "this shard trains (--optimizer): its optimizer owns the master, so it takes no "
        "publishes; publish to shards started without --optimizer");
  }
  return publications_;
}

grpc::ServerUnaryReactor* ShardAdminService::BeginPublish(
    grpc::CallbackServerContext* context, const layercast::v1::BeginPublishRequest* request,
    layercast::v1::BeginPublishResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Publications*> publications = PublicationsFor(*context);
  if (!publications.ok()) {
    return Finish(reactor, wire::ToGrpcStatus(publications.status()), "BeginPublish");
  }
  absl::StatusOr<uint64_t> staging = (*publications)->Begin(*request);
  if (staging.ok()) response->set_staging_bytes(*staging);
  return Finish(reactor, wire::ToGrpcStatus(staging.status()), "BeginPublish");
}

namespace {

// One StagePublish stream: stages each chunk as it arrives, and answers
// with the first error (the rest of the stream is read and dropped) or,
// when the publisher half-closes, with the elements staged.
class StagePublishReactor final : public grpc::ServerReadReactor<layercast::v1::PublishChunk> {
 public:
  StagePublishReactor(Publications* publications, ServerMetrics& metrics,
                      layercast::v1::StagePublishResponse* response)
      : publications_(publications), metrics_(metrics), response_(response) {
    StartRead(&chunk_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Done(status_);
      return;
    }
    if (status_.ok()) {
      absl::Status staged = publications_->Stage(chunk_);
      if (staged.ok()) {
        elements_ += chunk_.data().size() / DTypeSize(static_cast<DType>(chunk_.dtype()));
      } else {
        status_ = staged;
      }
    }
    StartRead(&chunk_);
  }
  void OnDone() override { delete this; }

 private:
  void Done(const absl::Status& status) {
    response_->set_elements(elements_);
    metrics_.RecordRpc("StagePublish",
                       wire::StatusCodeName(wire::ToGrpcStatus(status).error_code()));
    Finish(wire::ToGrpcStatus(status));
  }

  Publications* const publications_;
  ServerMetrics& metrics_;
  layercast::v1::StagePublishResponse* const response_;
  layercast::v1::PublishChunk chunk_;
  absl::Status status_;
  uint64_t elements_ = 0;
};

// A stream refused before it reads anything.
class RefusedStage final : public grpc::ServerReadReactor<layercast::v1::PublishChunk> {
 public:
  explicit RefusedStage(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerReadReactor<layercast::v1::PublishChunk>* ShardAdminService::StagePublish(
    grpc::CallbackServerContext* context, layercast::v1::StagePublishResponse* response) {
  absl::StatusOr<Publications*> publications = PublicationsFor(*context);
  if (!publications.ok()) {
    const grpc::Status status = wire::ToGrpcStatus(publications.status());
    metrics_.RecordRpc("StagePublish", wire::StatusCodeName(status.error_code()));
    return new RefusedStage(status);
  }
  return new StagePublishReactor(*publications, metrics_, response);
}

grpc::ServerUnaryReactor* ShardAdminService::CommitPublish(
    grpc::CallbackServerContext* context, const layercast::v1::CommitPublishRequest* request,
    layercast::v1::CommitPublishResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Publications*> publications = PublicationsFor(*context);
  if (!publications.ok()) {
    return Finish(reactor, wire::ToGrpcStatus(publications.status()), "CommitPublish");
  }
  absl::StatusOr<Publications::Committed> committed =
      (*publications)->Commit(request->publish_id());
  if (committed.ok()) {
    response->set_version(committed->version);
    response->set_changed_elements(committed->changed_elements);
  }
  return Finish(reactor, wire::ToGrpcStatus(committed.status()), "CommitPublish");
}

grpc::ServerUnaryReactor* ShardAdminService::AbortPublish(
    grpc::CallbackServerContext* context, const layercast::v1::AbortPublishRequest* request,
    layercast::v1::AbortPublishResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Publications*> publications = PublicationsFor(*context);
  if (!publications.ok()) {
    return Finish(reactor, wire::ToGrpcStatus(publications.status()), "AbortPublish");
  }
  (*publications)->Abort(request->publish_id());
  return Finish(reactor, grpc::Status::OK, "AbortPublish");
}

grpc::ServerUnaryReactor* ShardAdminService::ResolvePublish(
    grpc::CallbackServerContext* context, const layercast::v1::ResolvePublishRequest* request,
    layercast::v1::ResolvePublishResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Publications*> publications = PublicationsFor(*context);
  if (!publications.ok()) {
    return Finish(reactor, wire::ToGrpcStatus(publications.status()), "ResolvePublish");
  }
  *response = (*publications)->Resolve(request->publish_id(), request->fence());
  return Finish(reactor, grpc::Status::OK, "ResolvePublish");
}

}  // namespace layercast::server
