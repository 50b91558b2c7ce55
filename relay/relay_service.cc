#include "relay/relay_service.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "layercast/v1/config.pb.h"
#include "platform/status_macros.h"
#include "relay/relay_chunks.h"
#include "server/serving/answer_before.h"
#include "server/serving/fetch_layer_reactor.h"
#include "server/serving/refusals.h"
#include "server/serving/stream_reactor.h"
#include "server/serving/wait_version_reactor.h"
#include "wire/grpc_status.h"

namespace layercast::relay {

namespace {

grpc::Status ReadsOnly(absl::string_view what) {
  return wire::ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
      "this is a relay, which serves reads only: send ", what, " to the shards themselves")));
}

}  // namespace

RelayLimits RelayLimits::Defaults() {
  const auto shard_default = [](const char* field) {
    const google::protobuf::FieldDescriptor* descriptor =
        layercast::v1::ShardConfig::descriptor()->FindFieldByName(field);
    return static_cast<uint32_t>(descriptor->options().GetExtension(layercast::v1::default_value));
  };
  RelayLimits limits;
  limits.max_streams = shard_default("max_streams");
  limits.max_parked_streams = shard_default("max_parked_streams");
  limits.max_waits_per_connection = shard_default("max_waits_per_connection");
  limits.max_version_lead = shard_default("max_version_lead");
  limits.max_version_wait = std::chrono::milliseconds(10000);
  limits.write_progress_timeout =
      std::chrono::milliseconds(shard_default("write_progress_timeout_ms"));
  return limits;
}

RelayServing::RelayServing(const RelayLimits& limits, uint32_t layer_count)
    : limits(limits),
      layers(grants.get_executor(), 0, &timers),
      heading(grants.get_executor(), 0, &timers),
      budget(
          limits.memory_budget, 0, grants.get_executor(),
          [this](uint64_t in_use, size_t waiting) {
            metrics.memory_in_use_bytes().Set(static_cast<double>(in_use));
            metrics.streams_waiting_for_budget().Set(static_cast<double>(waiting));
          },
          &timers),
      streams({.max_streams = limits.max_streams,
               .max_parked_streams = limits.max_parked_streams,
               .max_waits_per_connection = limits.max_waits_per_connection,
               .write_progress_timeout = limits.write_progress_timeout},
              metrics, {}, &timers) {
  layers.SetLayers(layer_count);
  metrics.memory_budget_bytes().Set(static_cast<double>(limits.memory_budget.value_or(0)));
  // Serving from its start: reads wait for the layers to land, as a
  // shard's wait for a version.
  metrics.ready().Set(1);
}

RelayServing::~RelayServing() { grants.join(); }

void RelayServing::Moved(const RelayedVersions& versions, std::optional<uint32_t> layer) {
  if (layer) this->layers.Set(*layer, versions.Newest(*layer) + kHeld);
  heading.Set(versions.heading());
}

void RelayServing::Close() {
  layers.Close();
  heading.Close();
  streams.StopStreams();
}

RelayService::RelayService(const layercast::v1::Manifest& manifest, const wire::ShardSetView& view,
                           const std::vector<AssembledLayout>& layouts,
                           const RelayedVersions& versions, RelayMetrics& metrics,
                           RelayServing& serving)
    : manifest_(manifest),
      view_(view),
      layouts_(layouts),
      versions_(versions),
      metrics_(metrics),
      serving_(serving),
      shard_(manifest.shard_index()) {
  facts_ = {.model = &view_.model,
            .policy = &view_.policy,
            .layouts = view_.layouts,
            .shard_index = shard_,
            .num_shards = manifest.num_shards()};
  std::copy_n(manifest.content_fingerprint().begin(),
              std::min(manifest.content_fingerprint().size(), facts_.content_fingerprint.size()),
              facts_.content_fingerprint.begin());
  held_facts_ = facts_;
  held_facts_.layouts = layouts_;
}

grpc::ServerUnaryReactor* RelayService::FinishUnary(grpc::CallbackServerContext* context,
                                                    const char* method,
                                                    const grpc::Status& status) {
  return server::FinishUnary(serving_.metrics, context, method, status);
}

grpc::ServerUnaryReactor* RelayService::GetManifest(grpc::CallbackServerContext* context,
                                                    const layercast::v1::GetManifestRequest*,
                                                    layercast::v1::Manifest* manifest) {
  *manifest = manifest_;
  manifest->set_version(versions_.heading());
  return FinishUnary(context, "GetManifest", grpc::Status::OK);
}

grpc::ServerUnaryReactor* RelayService::WaitVersion(
    grpc::CallbackServerContext* context, const layercast::v1::WaitVersionRequest* request,
    layercast::v1::WaitVersionResponse* response) {
  if (versions_.closed()) {
    return FinishUnary(context, "WaitVersion",
                       wire::ToGrpcStatus(absl::UnavailableError(
                           "this relay is stopping: follow the shards, or another relay")));
  }
  const uint64_t incarnation = versions_.IncarnationOf(shard_);
  response->set_incarnation(incarnation);
  const uint64_t current = versions_.heading();
  // A caller holding another incarnation's versions is told at once: the
  // shards' numbers started again, so its min_version says nothing here.
  const bool restarted =
      request->has_incarnation() && incarnation != 0 && request->incarnation() != incarnation;
  if (request->min_version() <= current || restarted) {
    response->set_version(current);
    return FinishUnary(context, "WaitVersion", grpc::Status::OK);
  }
  const RelayLimits& limits = serving_.limits;
  if (request->min_version() - current > limits.max_version_lead) {
    return FinishUnary(context, "WaitVersion",
                       wire::ToGrpcStatus(absl::OutOfRangeError(
                           absl::StrCat("min_version ", request->min_version(), " is more than ",
                                        limits.max_version_lead, " versions ahead of this relay's ",
                                        current, " (--max-version-lead): wait for a nearer one"))));
  }
  const std::string peer = context->peer();
  if (grpc::Status admitted = serving_.streams.AddWait(peer); !admitted.ok()) {
    return FinishUnary(context, "WaitVersion", admitted);
  }
  const platform::Clock& clock = serving_.timers.clock();
  // A version that did not come reads as the version now, never as
  // DEADLINE_EXCEEDED.
  const auto answer_at = std::min(clock.Now() + limits.max_version_wait,
                                  server::AnswerBefore(context->deadline(), clock.Now()));
  auto* reactor = new server::WaitVersionReactor(
      serving_.heading, response, [this, peer](const grpc::Status& status) {
        serving_.metrics.RecordRpc("WaitVersion", wire::StatusCodeName(status.error_code()));
        serving_.streams.RemoveWait(peer);
      });
  reactor->Start(request->min_version(), answer_at);
  return reactor;
}

grpc::ServerUnaryReactor* RelayService::GetLayerDigest(grpc::CallbackServerContext* context,
                                                       const layercast::v1::GetLayerDigestRequest*,
                                                       layercast::v1::LayerDigest*) {
  return FinishUnary(context, "GetLayerDigest",
                     wire::ToGrpcStatus(absl::FailedPreconditionError(
                         "a relay does not vouch for the bytes it carries: ask the shards for "
                         "digests (MirrorOptions::verify_with; layercast fetch --verify-shards)")));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* RelayService::Refuse(const absl::Status& status) {
  const grpc::Status refused = wire::ToGrpcStatus(status);
  serving_.metrics.RecordRpc("FetchLayer", wire::StatusCodeName(refused.error_code()));
  metrics_.RecordServed(false, 0);
  return new server::RefusedStream<grpc::ServerWriteReactor<grpc::ByteBuffer>>(refused);
}

absl::StatusOr<server::FetchPlan> RelayService::Plan(
    const layercast::v1::FetchLayerRequest& request) const {
  // The base's incarnation is checked against the version kept
  // (RelayChunks), not one of the relay's own.
  layercast::v1::FetchLayerRequest planned = request;
  planned.clear_base_incarnation();
  const bool held_dtype = manifest_.has_held_dtype() && request.dtype() == manifest_.held_dtype();
  ASSIGN_OR_RETURN(server::FetchPlan plan,
                   server::PlanFetch(held_dtype ? held_facts_ : facts_, planned));
  const AssembledLayout& held = layouts_[request.layer()];
  for (uint32_t t = 0; t < held.tensors().size(); ++t) {
    const DType has = held.tensors()[t].compute_dtype;
    const DType asked = plan.layout.tensors()[t].compute_dtype;
    if (has != asked) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this relay holds layer ", request.layer(), "'s tensor ",
          view_.model.layers[request.layer()].tensors[t].name, " (", t, ") in ", DTypeName(has),
          ", not ", DTypeName(asked), ": ask in ", DTypeName(has),
          " (FetchLayerRequest.dtype; a mirror's MirrorOptions::dtype), or ask the shards, or a "
          "relay that follows in ",
          DTypeName(asked)));
    }
  }
  if (manifest_.chunk_bytes() == 0) {
    return absl::FailedPreconditionError(
        "the shard this relay follows does not name its chunk size (Manifest.chunk_bytes): "
        "upgrade the shards");
  }
  return plan;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* RelayService::FetchLayer(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) {
  layercast::v1::FetchLayerRequest request;
  grpc::ByteBuffer copy(*raw_request);  // ProtoBufferReader needs a mutable buffer
  grpc::ProtoBufferReader reader(&copy);
  if (!request.ParseFromZeroCopyStream(&reader)) {
    return Refuse(
        absl::InvalidArgumentError("the request is not a layercast.v1.FetchLayerRequest"));
  }
  if (versions_.closed()) {
    return Refuse(absl::UnavailableError(
        "this relay is stopping: read from the shards, or from another relay"));
  }
  absl::StatusOr<server::FetchPlan> plan = Plan(request);
  if (!plan.ok()) return Refuse(plan.status());
  // What the relay heads for counts: its layers land one by one.
  const uint64_t newest = std::max(serving_.layers.version(request.layer()), versions_.heading());
  const absl::StatusOr<server::FetchWait> wait =
      server::PlanWait(request, newest, serving_.limits.max_version_lead, true);
  if (!wait.ok()) return Refuse(wait.status());
  const platform::Clock& clock = serving_.timers.clock();
  server::FetchLayerReactor::Options stream;
  stream.chunk_bytes = manifest_.chunk_bytes();
  stream.min_version = wait->version;
  stream.clock = &clock;
  stream.version_give_up_at = std::min(clock.Now() + serving_.limits.max_version_wait,
                                       server::AnswerBefore(context->deadline(), clock.Now()));
  if (request.has_base_version()) {
    stream.base_version = request.base_version();
    stream.changed_gaps = request.accepts_changed_gaps();
  }
  stream.gate_offset = RelayServing::kHeld;
  stream.server = "relay";
  return serving_.streams.OpenStream(
      wait->parked, std::move(stream), [&](server::FetchLayerReactor::Options options) {
        // Counted as a shard counts its streams, and in the relay's own
        // served series.
        auto sent = std::make_shared<std::atomic<uint64_t>>(0);
        options.on_done = [this, on_done = std::move(options.on_done), sent](
                              server::FetchLayerReactor* stream, const grpc::Status& status) {
          metrics_.RecordServed(status.ok(), sent->load());
          on_done(stream, status);
        };
        auto chunks = std::make_unique<RelayChunks>(versions_, layouts_[request.layer()], shard_,
                                                    facts_.num_shards, request, context, sent);
        return new server::FetchLayerReactor(context, std::move(chunks), serving_.layers,
                                             serving_.budget, serving_.metrics, *std::move(plan),
                                             std::move(options));
      });
}

grpc::ServerReadReactor<layercast::v1::GradientChunk>* RelayService::PushGradients(
    grpc::CallbackServerContext*, layercast::v1::PushGradientsResponse*) {
  serving_.metrics.RecordRpc("PushGradients", "FAILED_PRECONDITION");
  return new server::RefusedStream<grpc::ServerReadReactor<layercast::v1::GradientChunk>>(
      ReadsOnly("gradients"));
}

grpc::ServerUnaryReactor* RelayService::GetGradientNorm(
    grpc::CallbackServerContext* context, const layercast::v1::GetGradientNormRequest*,
    layercast::v1::GetGradientNormResponse*) {
  return FinishUnary(context, "GetGradientNorm", ReadsOnly("GetGradientNorm"));
}

grpc::ServerUnaryReactor* RelayService::ApplyClippedStep(
    grpc::CallbackServerContext* context, const layercast::v1::ApplyClippedStepRequest*,
    layercast::v1::ApplyClippedStepResponse*) {
  return FinishUnary(context, "ApplyClippedStep", ReadsOnly("ApplyClippedStep"));
}

grpc::ServerUnaryReactor* RelayService::GetCastError(grpc::CallbackServerContext* context,
                                                     const layercast::v1::GetCastErrorRequest*,
                                                     layercast::v1::GetCastErrorResponse*) {
  return FinishUnary(
      context, "GetCastError",
      ReadsOnly("GetCastError (a relay casts nothing: what the casts lost is the shards')"));
}

}  // namespace layercast::relay
