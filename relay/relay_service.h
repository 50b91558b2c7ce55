#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "core/layout.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "relay/relay_metrics.h"
#include "relay/relayed_versions.h"
#include "server/fetch_plan.h"
#include "wire/manifest.h"

namespace layercast::relay {

// Shard `shard` of a set, as a relay serves it: its manifest, and its
// slice of every layer the relay holds, in the chunks the shard cuts (its
// Manifest.chunk_bytes), with the shard's versions, CRCs and incarnation.
// A relay never casts: full chunks are the bytes the shard cast, and a
// delta is what changed between two versions of them. Reads only: pushes
// and steps go to the shards.
//
// Synchronous gRPC: each stream holds a thread of the server's pool while
// it waits for a version or writes.
class RelayService final : public layercast::v1::ShardService::Service {
 public:
  struct Options {
    // The longest a read or WaitVersion waits for a version, whatever the
    // caller's deadline.
    std::chrono::milliseconds max_version_wait{10000};
  };
  // `layouts` are the layers as the relay holds them (the policy's, or in
  // the mirror's dtype). Everything referenced must outlive the service.
  RelayService(const layercast::v1::Manifest& manifest, const wire::ShardSetView& view,
               const std::vector<AssembledLayout>& layouts, const RelayedVersions& versions,
               RelayMetrics& metrics, Options options);

  grpc::Status GetManifest(grpc::ServerContext* context,
                           const layercast::v1::GetManifestRequest* request,
                           layercast::v1::Manifest* manifest) override;
  grpc::Status FetchLayer(grpc::ServerContext* context,
                          const layercast::v1::FetchLayerRequest* request,
                          grpc::ServerWriter<layercast::v1::LayerChunk>* writer) override;
  grpc::Status WaitVersion(grpc::ServerContext* context,
                           const layercast::v1::WaitVersionRequest* request,
                           layercast::v1::WaitVersionResponse* response) override;
  grpc::Status PushGradients(grpc::ServerContext* context,
                             grpc::ServerReader<layercast::v1::GradientChunk>* reader,
                             layercast::v1::PushGradientsResponse* response) override;
  grpc::Status GetGradientNorm(grpc::ServerContext* context,
                               const layercast::v1::GetGradientNormRequest* request,
                               layercast::v1::GetGradientNormResponse* response) override;
  grpc::Status ApplyClippedStep(grpc::ServerContext* context,
                                const layercast::v1::ApplyClippedStepRequest* request,
                                layercast::v1::ApplyClippedStepResponse* response) override;
  grpc::Status GetCastError(grpc::ServerContext* context,
                            const layercast::v1::GetCastErrorRequest* request,
                            layercast::v1::GetCastErrorResponse* response) override;
  // Refused (FAILED_PRECONDITION): a relay carries bytes and vouches for
  // none; digests come from the shards (docs/security.md).
  grpc::Status GetLayerDigest(grpc::ServerContext* context,
                              const layercast::v1::GetLayerDigestRequest* request,
                              layercast::v1::LayerDigest* response) override;

 private:
  // Which held version a read sends, and from which it is a delta.
  absl::StatusOr<HeldLayer> Target(const layercast::v1::FetchLayerRequest& request,
                                   absl::Time deadline) const;
  // A delta when `changed` (from `base_version`), else full chunks.
  absl::Status Send(const server::FetchPlan& plan, const HeldLayer& target,
                    const ChangedElements* changed, uint64_t base_version, bool gaps,
                    grpc::ServerWriter<layercast::v1::LayerChunk>* writer, uint64_t* sent) const;
  absl::Time Deadline(const grpc::ServerContext& context) const;

  const layercast::v1::Manifest& manifest_;
  const wire::ShardSetView& view_;
  const std::vector<AssembledLayout>& layouts_;
  const RelayedVersions& versions_;
  RelayMetrics& metrics_;
  const Options options_;
  const uint32_t shard_;
  server::FetchFacts facts_;
  // The same, with the layers as the relay holds them: a read naming the
  // dtype a relay holds (Manifest.held_dtype) is planned by these, so that
  // it is no dtype of its own to the plan, and gets deltas.
  server::FetchFacts held_facts_;
};

}  // namespace layercast::relay
