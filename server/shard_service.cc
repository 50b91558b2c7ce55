#include "server/shard_service.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"
#include "server/fetch_layer_reactor.h"
#include "server/fetch_plan.h"
#include "server/grpc_status.h"

namespace layercast::server {
namespace {

const grpc::Status kLoading(grpc::StatusCode::UNAVAILABLE,
                            "this shard is still loading its parameters; retry shortly (the "
                            "readiness health check turns SERVING when it is done)");

// A write reactor that only finishes with `status`: how a refused stream ends.
class RefusedStream final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

std::string CodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

}  // namespace

layercast::v1::Manifest BuildManifest(const ParameterStore& store) {
  layercast::v1::Manifest manifest;
  const ModelSpec& model = store.model();
  manifest.set_model_id(model.model_id);
  manifest.set_num_shards(store.num_shards());
  manifest.set_shard_index(store.shard_index());
  manifest.set_policy(store.policy().ToString());
  manifest.set_layout_digest(
      std::string(store.layout_digest().begin(), store.layout_digest().end()));
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    const LayerSpec& spec = model.layers[l];
    const AssembledLayout& layout = store.layout(l);
    layercast::v1::Layer* layer = manifest.add_layers();
    layer->set_index(l);
    layer->set_name(spec.name);
    layer->set_assembled_bytes(layout.total_bytes());
    for (uint32_t t = 0; t < spec.tensors.size(); ++t) {
      layercast::v1::Tensor* tensor = layer->add_tensors();
      tensor->set_name(spec.tensors[t].name);
      for (int64_t dim : spec.tensors[t].shape) tensor->add_shape(dim);
      tensor->set_param_dtype(layercast::v1::FLOAT32);
      tensor->set_compute_dtype(
          static_cast<layercast::v1::DType>(layout.tensors()[t].compute_dtype));
      tensor->set_byte_offset(layout.tensors()[t].byte_offset);
      tensor->set_num_elements(spec.tensors[t].num_elements);
    }
  }
  return manifest;
}

void ShardService::AttachStore(const ParameterStore* store, MemoryBudget* budget,
                               SharedChunks* shared) {
  auto manifest = std::make_unique<layercast::v1::Manifest>(BuildManifest(*store));
  metrics_.SetShardInfo(manifest->model_id(), manifest->shard_index(), manifest->num_shards(),
                        manifest->policy(), manifest->layers_size());
  metrics_.parameter_version().Set(static_cast<double>(gate_.version()));
  absl::MutexLock lock(&mu_);
  store_ = store;
  budget_ = budget;
  shared_ = shared;
  manifest_ = std::move(manifest);
}

int64_t ShardService::streams_in_flight() const {
  absl::MutexLock lock(&streams_mu_);
  return streams_in_flight_;
}

bool ShardService::WaitForStreams(absl::Time deadline) const {
  absl::MutexLock lock(&streams_mu_);
  const auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(streams_mu_) {
    return streams_in_flight_ == 0;
  };
  return streams_mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

ShardService::Loaded ShardService::loaded() const {
  absl::MutexLock lock(&mu_);
  return {store_, budget_, shared_};
}

grpc::ServerUnaryReactor* ShardService::GetManifest(grpc::CallbackServerContext* context,
                                                    const layercast::v1::GetManifestRequest*,
                                                    layercast::v1::Manifest* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  {
    absl::MutexLock lock(&mu_);
    if (manifest_ == nullptr) {
      metrics_.RecordRpc("GetManifest", CodeName(kLoading.error_code()));
      reactor->Finish(kLoading);
      return reactor;
    }
    *response = *manifest_;
  }
  response->set_version(gate_.version());
  metrics_.RecordRpc("GetManifest", "OK");
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ShardService::Refuse(const grpc::Status& status) {
  metrics_.RecordRpc("FetchLayer", CodeName(status.error_code()));
  return new RefusedStream(status);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ShardService::FetchLayer(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) {
  layercast::v1::FetchLayerRequest parsed;
  grpc::ByteBuffer copy(*raw_request);  // ProtoBufferReader needs a mutable buffer
  grpc::ProtoBufferReader reader(&copy);
  if (!parsed.ParseFromZeroCopyStream(&reader)) {
    return Refuse(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               "the request is not a layercast.v1.FetchLayerRequest"));
  }
  const layercast::v1::FetchLayerRequest* request = &parsed;
  if (draining_.load()) {
    return Refuse(grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        "this shard is shutting down and takes no new streams; retry against its replacement"));
  }
  auto [store, budget, shared] = loaded();
  if (store == nullptr) return Refuse(kLoading);
  absl::StatusOr<FetchPlan> plan = PlanFetch(*store, *request);
  if (!plan.ok()) return Refuse(ToGrpcStatus(plan.status()));

  bool admitted = false;
  {
    absl::MutexLock lock(&streams_mu_);
    admitted = streams_in_flight_ < static_cast<int64_t>(options_.max_streams);
    if (admitted) ++streams_in_flight_;
  }
  if (!admitted) {
    return Refuse(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("this shard already serves ", options_.max_streams,
                     " FetchLayer streams (--max-streams); retry with backoff, or raise "
                     "--max-streams")));
  }
  metrics_.streams_in_flight().Increment();
  FetchLayerReactor::Options reactor_options;
  reactor_options.chunk_bytes = options_.chunk_bytes;
  reactor_options.min_version = request->min_version();
  reactor_options.shared = shared;
  reactor_options.on_done = [this,
                             start = std::chrono::steady_clock::now()](const grpc::Status& status) {
    metrics_.RecordRpc("FetchLayer", CodeName(status.error_code()));
    if (status.ok()) {
      metrics_.RecordFetchDuration(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    metrics_.streams_in_flight().Decrement();
    absl::MutexLock lock(&streams_mu_);
    --streams_in_flight_;
  };
  return new FetchLayerReactor(context, *store, gate_, *budget, metrics_, *std::move(plan),
                               std::move(reactor_options));
}

}  // namespace layercast::server
