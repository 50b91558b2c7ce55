#pragma once

#include <boost/asio/thread_pool.hpp>
#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "core/layout.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "relay/relay_metrics.h"
#include "relay/relayed_versions.h"
#include "server/serving/deadline_timers.h"
#include "server/serving/fetch_plan.h"
#include "server/serving/memory_budget.h"
#include "server/serving/server_metrics.h"
#include "server/serving/stream_registry.h"
#include "server/serving/version_gate.h"
#include "wire/manifest.h"

namespace layercast::relay {

// A relay's limits: the shard's flags of the same names
// (docs/publishing.md).
struct RelayLimits {
  // The shard's defaults (config.proto's, read by reflection, so each is
  // written once), but a version wait of 10 s: a relay only follows.
  static RelayLimits Defaults();

  uint32_t max_streams = 0;
  uint32_t max_parked_streams = 0;
  uint32_t max_waits_per_connection = 0;
  uint32_t max_version_lead = 0;
  // The longest a read or WaitVersion waits for a version, whatever the
  // caller's deadline.
  std::chrono::milliseconds max_version_wait{0};
  std::chrono::milliseconds write_progress_timeout{0};
  // What the held versions and the streams' chunk buffers may take
  // together; nullopt: unlimited (still counted).
  std::optional<uint64_t> memory_budget;
};

// What every shard a relay answers as shares, as a shard's own serving
// parts: the streams and their slots and stall sweep, the version waits,
// the memory budget, the timers and the threads that run their grants.
class RelayServing {
 public:
  RelayServing(const RelayLimits& limits, uint32_t layers);
  ~RelayServing();

  // The held versions changed: wakes the reads and long polls they reach.
  void Moved(const RelayedVersions& versions, std::optional<uint32_t> layer);
  // Ends every wait and every stream at its next chunk: the relay stops.
  void Close();

  const RelayLimits limits;
  boost::asio::thread_pool grants{2};
  server::DeadlineTimers timers;
  server::ServerMetrics metrics;
  // What `layers` counts past a layer's newest version held: 0 there is
  // "nothing held yet", which a read of version 0 waits out.
  static constexpr uint64_t kHeld = 1;
  // Each layer's newest version held (plus kHeld), and the version the
  // mirror walks to.
  server::VersionGate layers;
  server::VersionGate heading;
  server::MemoryBudget budget;
  server::StreamRegistry streams;
};

// Shard `shard` of a set, as a relay serves it: its manifest, and its
// slice of every layer the relay holds, in the chunks the shard cuts (its
// Manifest.chunk_bytes), with the shard's versions, CRCs and incarnation.
// A relay never casts: full chunks are the bytes the shard cast, and a
// delta is what changed between two versions of them (RelayChunks). Reads
// only: pushes and steps go to the shards.
//
// The callback API, on the shard's serving core: FetchLayer is a
// server::FetchLayerReactor over RelayChunks, with the shard's limits; no
// call holds a thread while it waits.
class RelayService final
    : public layercast::v1::ShardService::WithCallbackMethod_GetManifest<
          layercast::v1::ShardService::WithRawCallbackMethod_FetchLayer<
              layercast::v1::ShardService::WithCallbackMethod_PushGradients<
                  layercast::v1::ShardService::WithCallbackMethod_GetGradientNorm<
                      layercast::v1::ShardService::WithCallbackMethod_ApplyClippedStep<
                          layercast::v1::ShardService::WithCallbackMethod_WaitVersion<
                              layercast::v1::ShardService::WithCallbackMethod_GetCastError<
                                  layercast::v1::ShardService::WithCallbackMethod_GetLayerDigest<
                                      layercast::v1::ShardService::Service>>>>>>>> {
 public:
  // `layouts` are the layers as the relay holds them (the policy's, or in
  // the mirror's dtype). Everything referenced must outlive the service.
  RelayService(const layercast::v1::Manifest& manifest, const wire::ShardSetView& view,
               const std::vector<AssembledLayout>& layouts, const RelayedVersions& versions,
               RelayMetrics& metrics, RelayServing& serving);

  grpc::ServerUnaryReactor* GetManifest(grpc::CallbackServerContext* context,
                                        const layercast::v1::GetManifestRequest* request,
                                        layercast::v1::Manifest* manifest) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* FetchLayer(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) override;
  grpc::ServerUnaryReactor* WaitVersion(grpc::CallbackServerContext* context,
                                        const layercast::v1::WaitVersionRequest* request,
                                        layercast::v1::WaitVersionResponse* response) override;
  grpc::ServerReadReactor<layercast::v1::GradientChunk>* PushGradients(
      grpc::CallbackServerContext* context,
      layercast::v1::PushGradientsResponse* response) override;
  grpc::ServerUnaryReactor* GetGradientNorm(
      grpc::CallbackServerContext* context, const layercast::v1::GetGradientNormRequest* request,
      layercast::v1::GetGradientNormResponse* response) override;
  grpc::ServerUnaryReactor* ApplyClippedStep(
      grpc::CallbackServerContext* context, const layercast::v1::ApplyClippedStepRequest* request,
      layercast::v1::ApplyClippedStepResponse* response) override;
  grpc::ServerUnaryReactor* GetCastError(grpc::CallbackServerContext* context,
                                         const layercast::v1::GetCastErrorRequest* request,
                                         layercast::v1::GetCastErrorResponse* response) override;
  // Refused (FAILED_PRECONDITION): a relay carries bytes and vouches for
  // none; digests come from the shards (docs/security.md).
  grpc::ServerUnaryReactor* GetLayerDigest(grpc::CallbackServerContext* context,
                                           const layercast::v1::GetLayerDigestRequest* request,
                                           layercast::v1::LayerDigest* response) override;

 private:
  // Validates and plans a read; the stream it becomes, or a refused one.
  absl::StatusOr<server::FetchPlan> Plan(const layercast::v1::FetchLayerRequest& request) const;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Refuse(const absl::Status& status);
  grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context, const char* method,
                                        const grpc::Status& status);

  const layercast::v1::Manifest& manifest_;
  const wire::ShardSetView& view_;
  const std::vector<AssembledLayout>& layouts_;
  const RelayedVersions& versions_;
  RelayMetrics& metrics_;
  RelayServing& serving_;
  const uint32_t shard_;
  server::FetchFacts facts_;
  // The same, with the layers as the relay holds them: a read naming the
  // dtype a relay holds (Manifest.held_dtype) is planned by these, so that
  // it is no dtype of its own to the plan, and gets deltas.
  server::FetchFacts held_facts_;
};

}  // namespace layercast::relay
