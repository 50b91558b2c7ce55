#include "server/shard/shard_service.h"

#include <grpc/grpc.h>

#include <grpcpp/support/proto_buffer_reader.h>
#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "server/casting/shard_chunks.h"
#include "server/serving/answer_before.h"
#include "server/serving/fetch_layer_reactor.h"
#include "server/serving/fetch_plan.h"
#include "server/serving/refusals.h"
#include "server/serving/wait_version_reactor.h"
#include "server/shard/memory_plan.h"
#include "server/training/push_gradients_reactor.h"
#include "wire/cast_error_report.h"
#include "wire/grpc_status.h"
#include "wire/incarnation.h"
#include "wire/manifest.h"

namespace layercast::server {

layercast::v1::Manifest BuildManifest(const ParameterStore& store, const LayerTrainer* trainer,
                                      uint64_t chunk_bytes) {
  return wire::BuildManifest({
      .model = &store.model(),
      .policy = &store.policy(),
      .layouts = store.layouts(),
      .num_shards = store.num_shards(),
      .shard_index = store.shard_index(),
      .layout_digest = store.layout_digest(),
      .content_fingerprint = store.content_fingerprint(),
      .incarnation = store.incarnation(),
      .data_parallel_workers = trainer != nullptr ? trainer->layers().workers() : 0,
      .optimizer = trainer != nullptr ? trainer->layers().spec().ToString() : "",
      .chunk_bytes = chunk_bytes,
  });
}

ShardService::ShardService(Options options, ServerMetrics& metrics,
                           boost::asio::any_io_executor grants, DeadlineTimers* timers)
    : options_(options),
      metrics_(metrics),
      clock_(timers != nullptr ? timers->clock() : platform::Clock::Steady()),
      gate_(grants, 0, timers),
      streams_(
          {.max_streams = options.max_streams,
           .max_parked_streams = options.max_parked_streams,
           .max_push_streams = options.max_push_streams,
           .max_push_streams_per_connection = options.max_push_streams_per_connection,
           .max_waits_per_connection = options.max_waits_per_connection,
           .write_progress_timeout = options.write_progress_timeout},
          metrics, [this] { UpdateStepGauges(); }, timers) {}

void ShardService::StartDraining() {
  draining_.store(true);
  gate_.Close();
}

void ShardService::StopStreams() { streams_.StopStreams(); }

void ShardService::AttachStore(LoadedShard& shard) {
  const ParameterStore& store = *shard.store;
  gate_.SetLayers(static_cast<uint32_t>(store.model().layers.size()));
  auto manifest = std::make_unique<layercast::v1::Manifest>(
      BuildManifest(store, shard.trainer.get(), options_.chunk_bytes));
  metrics_.SetShardInfo(manifest->model_id(), manifest->shard_index(), manifest->num_shards(),
                        manifest->policy(), manifest->layers_size(), manifest->incarnation());
  metrics_.parameter_version().Set(static_cast<double>(gate_.version()));
  for (uint32_t l = 0; l < store.model().layers.size(); ++l) {
    for (const AssembledTensor& tensor : store.layout(l).tensors()) {
      metrics_.PrepareSeries(l, tensor.compute_dtype);
    }
  }
  absl::MutexLock lock(&mu_);
  shard_ = &shard;
  manifest_ = std::move(manifest);
}

void ShardService::DetachStore() {
  absl::MutexLock lock(&mu_);
  shard_ = nullptr;
}

int64_t ShardService::streams_in_flight() const { return streams_.in_flight(); }

int64_t ShardService::streams_streaming() const { return streams_.streaming(); }

bool ShardService::WaitForStreams(absl::Time deadline) const {
  return streams_.WaitUntilIdle(deadline);
}

LoadedShard* ShardService::loaded() const {
  absl::MutexLock lock(&mu_);
  return shard_;
}

grpc::ServerUnaryReactor* ShardService::GetManifest(grpc::CallbackServerContext* context,
                                                    const layercast::v1::GetManifestRequest*,
                                                    layercast::v1::Manifest* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  {
    absl::MutexLock lock(&mu_);
    if (manifest_ == nullptr) {
      metrics_.RecordRpc("GetManifest", wire::StatusCodeName(grpc::StatusCode::UNAVAILABLE));
      reactor->Finish(LoadingRefusal());
      return reactor;
    }
    *response = *manifest_;
  }
  response->set_version(gate_.version());
  metrics_.RecordRpc("GetManifest", "OK");
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ShardService::GetCastError(
    grpc::CallbackServerContext* context, const layercast::v1::GetCastErrorRequest*,
    layercast::v1::GetCastErrorResponse* response) {
  if (loaded() == nullptr) return FinishUnary(context, "GetCastError", LoadingRefusal());
  for (float bound : CastError::kBounds) response->add_bounds(bound);
  if (options_.cast_errors != nullptr) {
    for (const CastErrorLedger::LayerSummary& summary : options_.cast_errors->Summarize()) {
      layercast::v1::LayerCastError* layer = response->add_layers();
      layer->set_layer(summary.layer);
      layer->set_dtype(static_cast<layercast::v1::DType>(summary.dtype));
      layer->set_version(summary.version);
      layer->set_chunks(summary.chunks);
      wire::CastErrorToProto(summary.error, layer);
    }
  }
  return FinishUnary(context, "GetCastError", grpc::Status::OK);
}

grpc::ServerUnaryReactor* ShardService::GetLayerDigest(
    grpc::CallbackServerContext* context, const layercast::v1::GetLayerDigestRequest* request,
    layercast::v1::LayerDigest* response) {
  if (draining_.load()) {
    return FinishUnary(context, "GetLayerDigest",
                       ShuttingDownRefusal("ask its replacement for the digest"));
  }
  LoadedShard* shard = loaded();
  if (shard == nullptr) return FinishUnary(context, "GetLayerDigest", LoadingRefusal());
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  shard->digests->Get(
      *request, [this, reactor, response](absl::StatusOr<layercast::v1::LayerDigest> digest) {
        if (digest.ok()) *response = *std::move(digest);
        const grpc::Status status =
            digest.ok() ? grpc::Status::OK : wire::ToGrpcStatus(digest.status());
        metrics_.RecordRpc("GetLayerDigest", wire::StatusCodeName(status.error_code()));
        reactor->Finish(status);
      });
  return reactor;
}

namespace {

// Where a stream of `request` takes its chunks from on `shard`: the
// master and its caster, the chunks other readers share, and the logs a
// delta or a pinned read needs.
ShardChunks::Options SourceFor(const layercast::v1::FetchLayerRequest& request,
                               const FetchPlan& plan, const LoadedShard& shard,
                               const ShardService::Options& options) {
  ShardChunks::Options source;
  source.chunk_bytes = options.chunk_bytes;
  if (request.has_exact_version()) source.exact_version = request.exact_version();
  // Also for a stream at a version its layer left: a layer whose change
  // changed no value is still served from the master.
  source.changes = shard.changes.get();
  source.pinned = shard.pinned.get();
  source.cast_errors = options.cast_errors;
  source.cast_error_sample_every = options.cast_error_sample_every;
  if (const LayerTrainer* trainer = shard.trainer.get(); trainer != nullptr) {
    source.waiting_for = [trainer](uint32_t layer) { return trainer->layers().WaitingFor(layer); };
  }
  source.shared = shard.shared.get();
  source.pool = shard.pool.get();
  source.cache = shard.cast_cache.get();
  if (request.has_base_version()) source.base_version = request.base_version();
  source.will_pull_deltas = request.will_pull_deltas();
  // The worker saw a chunk of this layer fail its checksum: the kept copy,
  // or a kept CRC, may be the corrupted one.
  source.recast = request.recast();
  if (plan.dtype) {
    // Cast for this stream alone: the shared chunks and the cast-error
    // ledger hold the policy's casts.
    source.shared = nullptr;
    source.cast_errors = nullptr;
  }
  if (request.recast() && source.shared != nullptr) {
    source.shared->DropLayer(request.layer());
    source.shared = nullptr;
  }
  return source;
}

// How a stream of `request` waits for its version and sends: its base for
// a delta, and when it gives up.
FetchLayerReactor::Options StreamFor(const layercast::v1::FetchLayerRequest& request,
                                     const FetchWait& wait, const ShardService::Options& options,
                                     platform::Clock& clock,
                                     const grpc::CallbackServerContext& context) {
  FetchLayerReactor::Options stream;
  stream.chunk_bytes = options.chunk_bytes;
  stream.min_version = wait.version;
  // Before the client's deadline, so that it hears what the version waits
  // for rather than gRPC's bare DEADLINE_EXCEEDED.
  stream.clock = &clock;
  stream.version_give_up_at = std::min(clock.Now() + options.max_version_wait,
                                       AnswerBefore(context.deadline(), clock.Now()));
  if (request.has_base_version()) {
    stream.base_version = request.base_version();
    stream.changed_gaps = request.accepts_changed_gaps();
  }
  return stream;
}

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* ShardService::Refuse(const grpc::Status& status) {
  metrics_.RecordRpc("FetchLayer", wire::StatusCodeName(status.error_code()));
  return new RefusedStream<grpc::ServerWriteReactor<grpc::ByteBuffer>>(status);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ShardService::FetchLayer(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) {
  layercast::v1::FetchLayerRequest parsed;
  grpc::ByteBuffer copy(*raw_request);  // ProtoBufferReader needs a mutable buffer
  grpc::ProtoBufferReader reader(&copy);
  if (!parsed.ParseFromZeroCopyStream(&reader)) {
    return Refuse(wire::ToGrpcStatus(
        absl::InvalidArgumentError("the request is not a layercast.v1.FetchLayerRequest")));
  }
  const layercast::v1::FetchLayerRequest* request = &parsed;
  if (draining_.load()) {
    return Refuse(ShuttingDownRefusal("it takes no new streams; retry against its replacement"));
  }
  LoadedShard* shard = loaded();
  if (shard == nullptr) return Refuse(LoadingRefusal());
  const ParameterStore* store = shard->store.get();
  // Which start of the shard serves the stream: the worker names it again
  // as the base of its next delta (FetchLayerRequest.base_incarnation).
  context->AddInitialMetadata(wire::kIncarnationMetadata, absl::StrCat(store->incarnation()));
  absl::StatusOr<FetchPlan> plan = PlanFetch(*store, *request);
  if (!plan.ok()) return Refuse(wire::ToGrpcStatus(plan.status()));
  if (const uint64_t least = LeastFp8ChunkBytes(store->policy().fp8_block());
      plan->dtype && IsFloat8(*plan->dtype) && options_.chunk_bytes < least) {
    // An 8-bit chunk holds whole blocks: a smaller one would outgrow what
    // the memory plan counts a stream as (MaxStreamBufferBytes).
    return Refuse(wire::ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("this shard's --chunk-bytes ", options_.chunk_bytes, " is below the ", least,
                     " bytes a chunk of ", DTypeName(*plan->dtype),
                     " needs (a block of fp8_block codes and its scales): pull in the policy's "
                     "dtypes, or start the shards with --chunk-bytes of at least ",
                     least))));
  }

  const absl::StatusOr<FetchWait> wait =
      PlanWait(*request, gate_.version(request->layer()), options_.max_version_lead,
               shard->changes != nullptr);
  if (!wait.ok()) return Refuse(wire::ToGrpcStatus(wait.status()));
  ShardChunks::Options source = SourceFor(*request, *plan, *shard, options_);
  FetchLayerReactor::Options stream = StreamFor(*request, *wait, options_, clock_, *context);
  return streams_.OpenStream(
      wait->parked, std::move(stream), [&](FetchLayerReactor::Options options) {
        auto chunks =
            std::make_unique<ShardChunks>(*store, gate_, metrics_, *plan, std::move(source));
        return new FetchLayerReactor(context, std::move(chunks), gate_, *shard->budget, metrics_,
                                     *std::move(plan), std::move(options));
      });
}

grpc::ServerUnaryReactor* ShardService::FinishUnary(grpc::CallbackServerContext* context,
                                                    const char* method,
                                                    const grpc::Status& status) {
  return server::FinishUnary(metrics_, context, method, status);
}

grpc::ServerUnaryReactor* ShardService::WaitVersion(
    grpc::CallbackServerContext* context, const layercast::v1::WaitVersionRequest* request,
    layercast::v1::WaitVersionResponse* response) {
  if (draining_.load()) {
    return FinishUnary(context, "WaitVersion", ShuttingDownRefusal("wait on its replacement"));
  }
  const LoadedShard* shard = loaded();
  if (shard == nullptr) return FinishUnary(context, "WaitVersion", LoadingRefusal());
  const uint64_t incarnation = shard->store->incarnation();
  response->set_incarnation(incarnation);
  const uint64_t current = gate_.version();
  // A caller holding another incarnation's versions is told at once: this
  // shard's numbers started again, so its min_version says nothing here.
  const bool restarted = request->has_incarnation() && request->incarnation() != incarnation;
  if (request->min_version() <= current || restarted) {
    response->set_version(current);
    return FinishUnary(context, "WaitVersion", grpc::Status::OK);
  }
  if (request->min_version() - current > options_.max_version_lead) {
    return FinishUnary(context, "WaitVersion",
                       wire::ToGrpcStatus(absl::OutOfRangeError(absl::StrCat(
                           "min_version ", request->min_version(), " is more than ",
                           options_.max_version_lead, " versions ahead of the shard's ", current,
                           " (--max-version-lead): wait for a nearer one"))));
  }
  const std::string peer = context->peer();
  if (grpc::Status admitted = streams_.AddWait(peer); !admitted.ok()) {
    return FinishUnary(context, "WaitVersion", admitted);
  }
  // A version that did not come reads as the version now, never as
  // DEADLINE_EXCEEDED.
  const auto answer_at = std::min(clock_.Now() + options_.max_version_wait,
                                  AnswerBefore(context->deadline(), clock_.Now()));
  auto* reactor = new WaitVersionReactor(gate_, response, [this, peer](const grpc::Status& status) {
    metrics_.RecordRpc("WaitVersion", wire::StatusCodeName(status.error_code()));
    streams_.RemoveWait(peer);
  });
  reactor->Start(request->min_version(), answer_at);
  return reactor;
}

}  // namespace layercast::server
