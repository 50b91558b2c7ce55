#include <bit>

#include "absl/strings/str_cat.h"
#include "server/serving/refusals.h"
#include "server/shard/shard_admin_service.h"
#include "wire/grpc_status.h"

// ShardAdmin's live hand-over calls: HandOver freezes a training shard at a
// step boundary, ReadState lets the new set read the frozen state, Unfreeze
// abandons the hand-over (docs/decisions.md).

namespace layercast::server {
namespace {

// The most elements one ReadState answers: 2 MiB, well inside gRPC's
// default 4 MiB message limit.
constexpr uint64_t kMaxReadStateElements = uint64_t{1} << 19;

}  // namespace

absl::StatusOr<LayerTrainer*> ShardAdminService::TrainerFor(
    const grpc::CallbackServerContext& context) {
  if (grpc::Status authorized = Authorize(context); !authorized.ok()) {
    return wire::FromGrpcStatus(authorized);
  }
  if (draining_.load()) {
    return absl::UnavailableError(ShuttingDownMessage(
        "its state cannot be handed over any more; fill the new set from the checkpoint it "
        "writes on exit instead (a resharded load)"));
  }
  absl::MutexLock lock(&mu_);
  if (store_ == nullptr) return absl::UnavailableError(kLoadingMessage);
  if (trainer_ == nullptr) {
    return absl::FailedPreconditionError(
        "this shard serves read-only (no --optimizer): it has no training state to hand over; "
        "start the new set from the same --model, or publish to it");
  }
  return trainer_;
}

grpc::ServerUnaryReactor* ShardAdminService::HandOver(grpc::CallbackServerContext* context,
                                                      const layercast::v1::HandOverRequest* request,
                                                      layercast::v1::HandOverResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<LayerTrainer*> trainer = TrainerFor(*context);
  if (!trainer.ok()) return Finish(reactor, wire::ToGrpcStatus(trainer.status()), "HandOver");
  if (request->has_at_version()) {
    if (absl::Status frozen = (*trainer)->hand_over().Freeze(request->at_version()); !frozen.ok()) {
      return Finish(reactor, wire::ToGrpcStatus(frozen), "HandOver");
    }
  }
  const std::optional<uint64_t> frozen_at = (*trainer)->hand_over().frozen_at();
  if (!frozen_at) {
    return Finish(reactor,
                  wire::ToGrpcStatus(absl::FailedPreconditionError(
                      "this shard is not handing over: freeze every shard of the old set first "
                      "(HandOver with at_version, e.g. the version the workers are about to "
                      "step to), then start the new set")),
                  "HandOver");
  }
  const CheckpointTraining header = (*trainer)->checkpoint().TrainingHeader();
  response->set_frozen_at(*frozen_at);
  response->set_at_boundary((*trainer)->hand_over().AtFrozenBoundary());
  {
    absl::MutexLock lock(&mu_);
    response->set_shard_index(store_->shard_index());
    response->set_num_shards(store_->num_shards());
    response->set_model_id(store_->model().model_id);
  }
  response->set_optimizer(header.optimizer);
  for (uint64_t version : header.layer_versions) response->add_layer_versions(version);
  for (uint64_t steps : header.optimizer_steps) response->add_optimizer_steps(steps);
  response->set_workers(static_cast<uint32_t>(header.workers));
  if (header.last_clip) {
    response->set_last_clip_step(header.last_clip->first);
    response->set_last_clip_scale_bits(std::bit_cast<uint32_t>(header.last_clip->second));
  }
  return Finish(reactor, grpc::Status::OK, "HandOver");
}

grpc::ServerUnaryReactor* ShardAdminService::Unfreeze(grpc::CallbackServerContext* context,
                                                      const layercast::v1::UnfreezeRequest*,
                                                      layercast::v1::UnfreezeResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<LayerTrainer*> trainer = TrainerFor(*context);
  if (trainer.ok()) (*trainer)->hand_over().Unfreeze();
  return Finish(reactor, wire::ToGrpcStatus(trainer.status()), "Unfreeze");
}

grpc::ServerUnaryReactor* ShardAdminService::ReadState(
    grpc::CallbackServerContext* context, const layercast::v1::ReadStateRequest* request,
    layercast::v1::ReadStateResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<LayerTrainer*> trainer = TrainerFor(*context);
  if (!trainer.ok()) return Finish(reactor, wire::ToGrpcStatus(trainer.status()), "ReadState");
  const ElementRange range{request->begin(), request->end()};
  if (range.begin > range.end || range.size() > kMaxReadStateElements) {
    return Finish(reactor,
                  wire::ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
                      "elements [", range.begin, ", ", range.end, "): ask for at most ",
                      kMaxReadStateElements, " elements per ReadState, begin <= end"))),
                  "ReadState");
  }
  std::string& data = *response->mutable_data();
  data.resize(range.size() * sizeof(float));
  const absl::Status read = (*trainer)->hand_over().ReadFrozen(
      request->layer(), request->tensor(), request->buffer(), range,
      {reinterpret_cast<float*>(data.data()), range.size()});
  if (!read.ok()) data.clear();
  return Finish(reactor, wire::ToGrpcStatus(read), "ReadState");
}

}  // namespace layercast::server
