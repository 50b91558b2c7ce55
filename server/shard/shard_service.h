#pragma once

#include <atomic>
#include <boost/asio/any_io_executor.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "platform/clock.h"
#include "server/access/worker_tokens.h"
#include "server/casting/cast_error_ledger.h"
#include "server/serving/change_log.h"
#include "server/serving/fetch_layer_reactor.h"
#include "server/serving/memory_budget.h"
#include "server/serving/parameter_store.h"
#include "server/serving/server_metrics.h"
#include "server/serving/shared_chunks.h"
#include "server/serving/stream_registry.h"
#include "server/serving/version_gate.h"
#include "server/shard/loaded_shard.h"
#include "server/training/layer_trainer.h"
#include "server/training/push_gradients_reactor.h"

namespace layercast::server {

// The gRPC ShardService of one shard, on the callback API (FetchLayer in its
// raw form, to keep copies off the hot path). Until a store is
// attached (parameters still loading) every call is refused with UNAVAILABLE;
// after StartDraining() new FetchLayer calls are refused with UNAVAILABLE,
// parked streams end with UNAVAILABLE, and streams in flight go on.
//
// What a stream may hold: a stream parked for a future min_version holds no
// budget and no --max-streams slot, only one of --max-parked-streams, for at
// most --max-version-wait-ms, and only for a version at most
// --max-version-lead ahead; a streaming one holds a --max-streams slot and
// two chunks of budget, and loses both when its reader does not drain a
// chunk within --write-progress-timeout-ms (StreamRegistry's sweep). A
// PushGradients stream holds its staging, and loses it when its worker sends
// no chunk within the same timeout.
//
// Thread-safe: gRPC calls its handlers from many threads.
class ShardService final
    : public layercast::v1::ShardService::WithCallbackMethod_GetManifest<
          layercast::v1::ShardService::WithRawCallbackMethod_FetchLayer<
              layercast::v1::ShardService::WithRawCallbackMethod_PushGradients<
                  layercast::v1::ShardService::WithCallbackMethod_GetGradientNorm<
                      layercast::v1::ShardService::WithCallbackMethod_ApplyClippedStep<
                          layercast::v1::ShardService::WithCallbackMethod_WaitVersion<
                              layercast::v1::ShardService::WithCallbackMethod_GetCastError<
                                  layercast::v1::ShardService::WithCallbackMethod_GetLayerDigest<
                                      layercast::v1::ShardService::Service>>>>>>>> {
 public:
  // Each from the resolved ShardConfig of the same name; config.proto holds
  // the defaults, so none is written here.
  struct Options {
    uint64_t chunk_bytes = 0;
    // FetchLayer streams streaming at most (--max-streams); more are refused
    // with RESOURCE_EXHAUSTED.
    uint32_t max_streams = 0;
    // Streams parked for a future min_version at most (--max-parked-streams).
    uint32_t max_parked_streams = 0;
    // PushGradients streams open at most (--max-push-streams), and from
    // one connection (--max-push-streams-per-connection; 0: no such limit).
    uint32_t max_push_streams = 0;
    uint32_t max_push_streams_per_connection = 0;
    // WaitVersion calls one connection may have parked at once
    // (--max-waits-per-connection).
    uint32_t max_waits_per_connection = 0;
    // How far ahead of the shard's version a min_version may be.
    uint32_t max_version_lead = 0;
    std::chrono::milliseconds max_version_wait{0};
    std::chrono::milliseconds write_progress_timeout{0};
    // Set (--worker-token-dir): a push for worker k, and a clip scale
    // (worker 0's), need worker k's token.
    std::optional<WorkerTokens> worker_tokens;
    // What each chunk's cast lost; null: measured on every cast, and
    // GetCastError lists nothing.
    CastErrorLedger* cast_errors = nullptr;
    // --cast-error-sample-every (CastError::sample_every).
    uint32_t cast_error_sample_every = 0;
  };

  // `metrics` must outlive the service; `grants` (the shard's grant
  // executor, see VersionGate) must outlive every stream; `timers` (the
  // shard's timer thread, for the gate and the stream registry) must
  // outlive the service, or be null for threads of their own.
  ShardService(Options options, ServerMetrics& metrics, boost::asio::any_io_executor grants,
               DeadlineTimers* timers = nullptr);
  // REQUIRES: no stream in flight (the server has shut down).
  ~ShardService() = default;

  // Serves from `shard` (which must stay until DetachStore) from now on;
  // called once. Until then every call is refused as loading. Without a
  // trainer the shard serves read-only and refuses gradients; without a
  // change log it refuses delta pulls; without pinned versions, pinned
  // reads of old versions; without shared chunks every stream casts its
  // own.
  void AttachStore(LoadedShard& shard);
  // Serves from nothing again (the shard is about to go). REQUIRES: no call
  // in flight (the server has shut down).
  void DetachStore();
  // Refuses new streams and ends parked ones, both with UNAVAILABLE.
  void StartDraining();
  // Ends every stream in flight with UNAVAILABLE at its next chunk boundary
  // (the drain timeout has passed): the worker resumes the rest against the
  // shard's replacement instead of seeing the call cancelled.
  void StopStreams();

  VersionGate& version_gate() { return gate_; }
  // FetchLayer streams started and not yet done, parked ones included.
  int64_t streams_in_flight() const;
  // Of those, the ones streaming (not parked for a version).
  int64_t streams_streaming() const;
  // Waits until no stream is in flight or `deadline` passes; true if none is.
  bool WaitForStreams(absl::Time deadline) const;

  grpc::ServerUnaryReactor* GetManifest(grpc::CallbackServerContext* context,
                                        const layercast::v1::GetManifestRequest* request,
                                        layercast::v1::Manifest* response) override;
  // Raw: the request is parsed here and chunks are written as ByteBuffers
  // built around the cast bytes (see EncodeLayerChunk).
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchLayer(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request) override;
  // Takes one worker's gradient of one layer (see PushGradientsReactor);
  // FAILED_PRECONDITION on a shard without an optimizer, which serves its
  // parameters read-only. Raw: each chunk's data is widened straight from
  // gRPC's receive buffer (wire::ReadGradientChunk).
  grpc::ServerReadReactor<grpc::ByteBuffer>* PushGradients(grpc::CallbackServerContext* context,
                                                           grpc::ByteBuffer* response) override;
  // Global-norm clipping (TrainerClip::NormOfStep, ApplyClippedStep);
  // FAILED_PRECONDITION on a shard without an optimizer.
  grpc::ServerUnaryReactor* GetGradientNorm(
      grpc::CallbackServerContext* context, const layercast::v1::GetGradientNormRequest* request,
      layercast::v1::GetGradientNormResponse* response) override;
  grpc::ServerUnaryReactor* ApplyClippedStep(
      grpc::CallbackServerContext* context, const layercast::v1::ApplyClippedStepRequest* request,
      layercast::v1::ApplyClippedStepResponse* response) override;
  // Parks like a FetchLayer stream waiting for its min_version, and answers
  // the version when it comes or the wait ends; a cancelled call frees its
  // slot at once (WaitVersionReactor).
  grpc::ServerUnaryReactor* WaitVersion(grpc::CallbackServerContext* context,
                                        const layercast::v1::WaitVersionRequest* request,
                                        layercast::v1::WaitVersionResponse* response) override;
  // What the casts lost, by layer and dtype (CastErrorLedger::Summarize).
  grpc::ServerUnaryReactor* GetCastError(grpc::CallbackServerContext* context,
                                         const layercast::v1::GetCastErrorRequest* request,
                                         layercast::v1::GetCastErrorResponse* response) override;
  // Answered from the LayerDigests thread once computed (LayerDigests::Get).
  // Set once the shard drains: long background work stops at it.
  const std::atomic<bool>* draining() const { return &draining_; }
  grpc::ServerUnaryReactor* GetLayerDigest(grpc::CallbackServerContext* context,
                                           const layercast::v1::GetLayerDigestRequest* request,
                                           layercast::v1::LayerDigest* response) override;

 private:
  // The shard served from; null while loading.
  LoadedShard* loaded() const;
  // A FetchLayer call refused before streaming, counted like any other.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Refuse(const grpc::Status& status);
  // The trainer, or the status a training RPC is refused with: loading,
  // or no optimizer.
  absl::StatusOr<LayerTrainer*> Trainer() const;
  grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context, const char* method,
                                        const grpc::Status& status);
  // With worker tokens, whether the call carries worker `worker`'s; OK
  // without them.
  absl::Status AuthorizeWorker(const grpc::CallbackServerContext& context, uint32_t worker,
                               absl::string_view what) const;
  // Sets the gauges of the oldest open layer step.
  void UpdateStepGauges();

  const Options options_;
  ServerMetrics& metrics_;
  // The timers' clock: deadlines given to them are read on it.
  platform::Clock& clock_;
  VersionGate gate_;
  std::atomic<bool> draining_{false};
  mutable absl::Mutex mu_;
  LoadedShard* shard_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Built once when the store is attached; the version is filled per call.
  std::unique_ptr<const layercast::v1::Manifest> manifest_ ABSL_GUARDED_BY(mu_);
  // Last: its sweep (UpdateStepGauges) uses everything above, and it is
  // destroyed first, stopping the sweep.
  StreamRegistry streams_;
};

// The manifest of `store` (wire::BuildManifest), with the training set's
// workers and optimizer when `trainer` is not null, and its chunk size.
layercast::v1::Manifest BuildManifest(const ParameterStore& store, const LayerTrainer* trainer,
                                      uint64_t chunk_bytes = 0);

}  // namespace layercast::server
