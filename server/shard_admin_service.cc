#include "server/shard_admin_service.h"

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "server/shard_checkpoint.h"
#include "wire/grpc_status.h"

namespace layercast::server {

ShardAdminService::ShardAdminService(Options options, const VersionGate& gate,
                                     ServerMetrics& metrics)
    : options_(std::move(options)), gate_(gate), metrics_(metrics) {}

ShardAdminService::~ShardAdminService() {
  std::thread writer;
  {
    absl::MutexLock lock(&mu_);
    writer = std::move(writer_);
  }
  if (writer.joinable()) writer.join();
}

void ShardAdminService::AttachStore(const ParameterStore* store, LayerTrainer* trainer) {
  absl::MutexLock lock(&mu_);
  store_ = store;
  trainer_ = trainer;
}

grpc::Status ShardAdminService::Authorize(const grpc::CallbackServerContext& context) const {
  if (!options_.token) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this shard has no admin token, so it refuses every ShardAdmin call: "
                        "start it with --admin-token-file FILE (see docs/security.md)");
  }
  const auto& metadata = context.client_metadata();
  const auto entry = metadata.find("authorization");
  std::optional<std::string> authorization;
  if (entry != metadata.end()) authorization.emplace(entry->second.data(), entry->second.size());
  return wire::ToGrpcStatus(options_.token->Check(authorization ? &*authorization : nullptr));
}

grpc::ServerUnaryReactor* ShardAdminService::Finish(grpc::ServerUnaryReactor* reactor,
                                                    const grpc::Status& status) {
  metrics_.RecordRpc("Checkpoint", wire::StatusCodeName(status.error_code()));
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
    return Finish(reactor, grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                        "this shard has no checkpoint directory: start it with "
                                        "--checkpoint-dir DIR"));
  }
  if (draining_.load()) {
    return Finish(reactor,
                  grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               "this shard is shutting down; it writes its checkpoint on exit "
                               "unless started with --checkpoint-on-sigterm false"));
  }
  absl::MutexLock lock(&mu_);
  if (store_ == nullptr) {
    return Finish(reactor, grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                        "this shard is still loading its parameters; retry when "
                                        "its readiness health check is SERVING"));
  }
  if (writing_) {
    return Finish(reactor, grpc::Status(grpc::StatusCode::ABORTED,
                                        absl::StrCat("a checkpoint of this shard is being "
                                                     "written to ",
                                                     options_.checkpoints->path(),
                                                     "; wait for it to finish and retry")));
  }
  // The previous writer has finished (writing_ is false); reap it.
  if (writer_.joinable()) writer_.join();
  writing_ = true;
  writer_ = std::thread([this, reactor, response, store = store_, trainer = trainer_] {
    absl::StatusOr<CheckpointInfo> info =
        WriteShardCheckpoint(*options_.checkpoints, *store, trainer, gate_.version(), true);
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

}  // namespace layercast::server
