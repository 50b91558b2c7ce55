#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "server/memory_budget.h"
#include "server/parameter_store.h"
#include "server/server_metrics.h"
#include "server/shared_chunks.h"
#include "server/version_gate.h"

namespace layercast::server {

// The gRPC ShardService of one shard, on the callback API (FetchLayer in its
// raw form, to keep copies off the hot path). Until a store is
// attached (parameters still loading) every call is refused with UNAVAILABLE;
// after StartDraining() new FetchLayer calls are refused with UNAVAILABLE
// while streams in flight go on.
//
// Thread-safe: gRPC calls its handlers from many threads.
class ShardService final : public layercast::v1::ShardService::WithCallbackMethod_GetManifest<
                               layercast::v1::ShardService::WithRawCallbackMethod_FetchLayer<
                                   layercast::v1::ShardService::Service>> {
 public:
  struct Options {
    uint64_t chunk_bytes = 1 << 20;
    // FetchLayer streams in flight at most (--max-streams); more are refused
    // with RESOURCE_EXHAUSTED.
    uint32_t max_streams = 1024;
  };

  // `metrics` must outlive the service.
  ShardService(Options options, ServerMetrics& metrics) : options_(options), metrics_(metrics) {}

  // Makes the loaded parameters available; called once. All must outlive
  // the service; `shared` may be null (every stream casts its own chunks).
  void AttachStore(const ParameterStore* store, MemoryBudget* budget, SharedChunks* shared);
  void StartDraining() { draining_.store(true); }

  VersionGate& version_gate() { return gate_; }
  // FetchLayer streams started and not yet done.
  int64_t streams_in_flight() const;
  // Waits until no stream is in flight or `deadline` passes; true if none is.
  bool WaitForStreams(absl::Time deadline) const;

  grpc::ServerUnaryReactor* GetManifest(grpc::CallbackServerContext* context,
                                        const layercast::v1::GetManifestRequest* request,
                                        layercast::v1::Manifest* response) override;
  // Raw: the request is parsed here and chunks are written as ByteBuffers
  // built around the cast bytes (see EncodeLayerChunk).
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchLayer(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request) override;

 private:
  struct Loaded {
    const ParameterStore* store = nullptr;  // null while loading
    MemoryBudget* budget = nullptr;
    SharedChunks* shared = nullptr;
  };
  Loaded loaded() const;
  // A FetchLayer call refused before streaming, counted like any other.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Refuse(const grpc::Status& status);

  const Options options_;
  ServerMetrics& metrics_;
  VersionGate gate_;
  std::atomic<bool> draining_{false};
  mutable absl::Mutex streams_mu_;
  int64_t streams_in_flight_ ABSL_GUARDED_BY(streams_mu_) = 0;
  mutable absl::Mutex mu_;
  const ParameterStore* store_ ABSL_GUARDED_BY(mu_) = nullptr;
  MemoryBudget* budget_ ABSL_GUARDED_BY(mu_) = nullptr;
  SharedChunks* shared_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Built once when the store is attached; the version is filled per call.
  std::unique_ptr<const layercast::v1::Manifest> manifest_ ABSL_GUARDED_BY(mu_);
};

// The manifest of `store`, version 0.
layercast::v1::Manifest BuildManifest(const ParameterStore& store);

}  // namespace layercast::server
