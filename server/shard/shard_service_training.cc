#include "server/shard/shard_service.h"

#include "absl/strings/str_cat.h"
#include "server/access/call_authorization.h"
#include "server/serving/refusals.h"
#include "server/training/push_gradients_reactor.h"
#include "wire/grpc_status.h"

// ShardService's training calls: PushGradients, GetGradientNorm and
// ApplyClippedStep, on a shard started with --optimizer.

namespace layercast::server {

void ShardService::UpdateStepGauges() {
  // Under the lock DetachStore takes, so the trainer stays while it is read.
  absl::MutexLock lock(&mu_);
  if (shard_ == nullptr || shard_->trainer == nullptr) return;
  const LayerTrainer::OpenStep oldest = shard_->trainer->layers().OldestOpenStep();
  metrics_.step_missing_workers().Set(oldest.missing_workers);
  metrics_.step_wait_seconds().Set(oldest.waited_seconds);
}

grpc::ServerReadReactor<grpc::ByteBuffer>* ShardService::PushGradients(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  const auto refuse = [this](const grpc::Status& status) {
    metrics_.RecordRpc("PushGradients", wire::StatusCodeName(status.error_code()));
    return new RefusedStream<grpc::ServerReadReactor<grpc::ByteBuffer>>(status);
  };
  if (draining_.load()) {
    return refuse(ShuttingDownRefusal(
        "it takes no new pushes; nothing of this one was staged: push it again to the shard's "
        "replacement"));
  }
  absl::StatusOr<LayerTrainer*> trainer = Trainer();
  if (!trainer.ok()) return refuse(wire::ToGrpcStatus(trainer.status()));
  LoadedShard& shard = *loaded();  // Trainer() found it
  PushGradientsReactor::Options options;
  if (options_.worker_tokens) {
    // Credentials first, from the call's metadata, before the stream takes
    // a slot: a stranger's idle streams used to hold every --max-push-streams
    // slot until their first chunk was checked.
    const std::optional<std::string> authorization = AuthorizationOf(*context);
    if (absl::StatusOr<uint32_t> worker =
            options_.worker_tokens->Identify(authorization ? &*authorization : nullptr, "a push");
        !worker.ok()) {
      return refuse(wire::ToGrpcStatus(worker.status()));
    }
    // The worker is named by the first chunk: it must be the token's, checked
    // then, before anything is staged.
    options.authorize = [this, context](uint32_t worker) {
      return AuthorizeWorker(*context, worker, "a push");
    };
  }
  std::string peer = context->peer();
  // As long as a parked stream may wait for a version: a push waiting for
  // budget waits for other workers' pushes to complete a step.
  options.clock = &clock_;
  options.budget_give_up_at = clock_.Now() + options_.max_version_wait;
  options.on_done = [this, peer](PushGradientsReactor* push, const grpc::Status& status,
                                 uint64_t bytes,
                                 const std::optional<LayerTrainer::Pushed>& pushed) {
    streams_.RemovePush(push, peer);
    metrics_.RecordRpc("PushGradients", wire::StatusCodeName(status.error_code()));
    if (!pushed) {
      metrics_.RecordPushRefused(bytes);
    } else if (pushed->applied) {
      metrics_.RecordPushApplied(bytes, pushed->optimizer_seconds, pushed->step_seconds);
      metrics_.parameter_version().Set(static_cast<double>(gate_.version()));
    } else {
      metrics_.RecordPushStaged(bytes);
    }
  };
  absl::StatusOr<StreamRegistry::PushStream*> push = streams_.AddPush(peer, [&] {
    return new PushGradientsReactor(context, *shard.store, **trainer, *shard.budget, response,
                                    std::move(options));
  });
  if (!push.ok()) return refuse(wire::ToGrpcStatus(push.status()));
  return *push;
}

absl::StatusOr<LayerTrainer*> ShardService::Trainer() const {
  LoadedShard* shard = loaded();
  if (shard == nullptr) return absl::UnavailableError(kLoadingMessage);
  if (shard->trainer == nullptr) {
    return absl::FailedPreconditionError(
        "this shard has no optimizer: it serves its parameters read-only and takes no gradients "
        "(start it with --optimizer to train)");
  }
  return shard->trainer.get();
}

absl::Status ShardService::AuthorizeWorker(const grpc::CallbackServerContext& context,
                                           uint32_t worker, absl::string_view what) const {
  if (!options_.worker_tokens) return absl::OkStatus();
  const std::optional<std::string> authorization = AuthorizationOf(context);
  return options_.worker_tokens->Check(worker, authorization ? &*authorization : nullptr, what);
}

grpc::ServerUnaryReactor* ShardService::GetGradientNorm(
    grpc::CallbackServerContext* context, const layercast::v1::GetGradientNormRequest* request,
    layercast::v1::GetGradientNormResponse* response) {
  absl::StatusOr<LayerTrainer*> trainer = Trainer();
  if (!trainer.ok()) {
    return FinishUnary(context, "GetGradientNorm", wire::ToGrpcStatus(trainer.status()));
  }
  const LayerTrainer::StepNorm norm = (*trainer)->clip().NormOfStep(request->step());
  response->set_ready(norm.ready);
  if (norm.ready) response->set_sum_of_squares(norm.sum_of_squares);
  for (uint32_t layer : norm.waiting_layers) response->add_waiting_layers(layer);
  response->set_clip_max_norm(norm.max_norm);
  if (norm.applied_scale) response->set_applied_scale(*norm.applied_scale);
  return FinishUnary(context, "GetGradientNorm", grpc::Status::OK);
}

grpc::ServerUnaryReactor* ShardService::ApplyClippedStep(
    grpc::CallbackServerContext* context, const layercast::v1::ApplyClippedStepRequest* request,
    layercast::v1::ApplyClippedStepResponse* response) {
  absl::StatusOr<LayerTrainer*> trainer = Trainer();
  if (!trainer.ok()) {
    return FinishUnary(context, "ApplyClippedStep", wire::ToGrpcStatus(trainer.status()));
  }
  // Worker 0 applies the clip scale (the worker library's FinishStep).
  if (absl::Status authorized = AuthorizeWorker(*context, 0, "a clip scale"); !authorized.ok()) {
    return FinishUnary(context, "ApplyClippedStep", wire::ToGrpcStatus(authorized));
  }
  // Every layer's optimizer step runs here, on this gRPC thread: the
  // workers wait for this version anyway.
  absl::StatusOr<uint64_t> version =
      (*trainer)->clip().ApplyClippedStep(request->step(), request->scale());
  if (!version.ok()) {
    return FinishUnary(context, "ApplyClippedStep", wire::ToGrpcStatus(version.status()));
  }
  response->set_version(*version);
  metrics_.parameter_version().Set(static_cast<double>(gate_.version()));
  return FinishUnary(context, "ApplyClippedStep", grpc::Status::OK);
}

}  // namespace layercast::server
