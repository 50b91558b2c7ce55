#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "client/client_defaults.h"
#include "client/layer.h"
#include "client/layer_source.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "wire/manifest.h"

namespace layercast::client {

struct ShardSetOptions {
  // How long Connect waits for every shard to answer GetManifest, retrying
  // shards that are unreachable or still loading.
  std::chrono::milliseconds connect_timeout = kConnectTimeout;
  // Where the worker library's metrics go; none if null.
  std::shared_ptr<prometheus::Registry> registry;
  // Channel credentials (TLS, mutual TLS); plaintext when null.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // How the caller names the shard list and connect_timeout, in messages
  // that say what to change: the `layercast` tool's flags unless set (the
  // Python package names its arguments).
  std::string shards_name = "--shards";
  std::string connect_timeout_name = "--connect-timeout-ms";
};

// A connection to a whole shard set, which has agreed on one model, policy
// and layout. Gathers layers by streaming from every shard at once, each
// chunk written straight into its place in one assembled buffer.
//
// Thread-safe: Gather may be called concurrently (each call has its own
// streams); the set itself is immutable after Connect.
class ShardSet final : public LayerSource {
 public:
  // Fetches every manifest concurrently and checks they form one set (see
  // CheckShardSet). `addresses` are host:port in shard order.
  static absl::StatusOr<std::unique_ptr<ShardSet>> Connect(std::vector<std::string> addresses,
                                                           ShardSetOptions options = {});

  const wire::ShardSetView& view() const override { return view_; }
  const ModelSpec& model() const { return view_.model; }
  const std::vector<std::string>& addresses() const { return addresses_; }
  // Connected with channel credentials (ShardSetOptions::credentials), so
  // over TLS, rather than in plaintext.
  bool tls() const { return tls_; }
  // The manifests as fetched, in shard order.
  const std::vector<layercast::v1::Manifest>& manifests() const { return manifests_; }

  // Gathers layer `layer` into a newly allocated buffer: RESOURCE_EXHAUSTED
  // when the host cannot give that much (a LayerStream bounds it by budget);
  // INVALID_ARGUMENT with options.dtype (GatherInto takes that).
  absl::StatusOr<Layer> Gather(uint32_t layer, const GatherOptions& options = {}) const;

  // Gathers layer `layer` into `buffer`, which must hold at least the layer's
  // assembled bytes; returns the parameter version. Errors name the shard:
  // - UNAVAILABLE: a shard stayed unreachable (dead, draining, restarting)
  //   until the deadline; DEADLINE_EXCEEDED: the timeout passed mid-stream;
  // - DATA_LOSS: a shard kept sending elements it does not own, twice, out of
  //   order, or with a bad CRC-32C, until the deadline;
  // - ABORTED: the shards' parameter versions moved during the gather (it
  //   never mixes two); gather again with the newer min_version; or, with
  //   options.exact_version, a shard no longer keeps that version;
  // - FAILED_PRECONDITION: a shard now serves other values than the set was
  //   connected to, or refuses the request's dtype;
  // - NOT_FOUND / INVALID_ARGUMENT / OUT_OF_RANGE: no such layer, a bad byte
  //   range or buffer, a min_version too far ahead;
  // - RESOURCE_EXHAUSTED: a shard had no budget or stream slot in time;
  // - CANCELLED: options.cancellation fired.
  absl::StatusOr<uint64_t> GatherInto(uint32_t layer, const GatherOptions& options,
                                      std::span<uint8_t> buffer) const override;

  // The version shard 0 serves now (its lowest layer's): what a walk of
  // the whole model at one version pins (GatherOptions.exact_version).
  // Errors are the call's, naming the shard.
  absl::StatusOr<uint64_t> CurrentVersion(
      std::chrono::milliseconds timeout = std::chrono::seconds(10)) const;
  // The version shard 0 serves now with what makes it an identity: per
  // shard, the incarnation serving (WaitVersionResponse.incarnation; 0
  // where a shard does not say). A version read before with other
  // incarnations may name other bits. One small call per shard; `cancel`
  // (if set) ends it CANCELLED.
  struct Identity {
    uint64_t version = 0;
    std::vector<uint64_t> incarnations;
  };
  absl::StatusOr<Identity> CurrentIdentity(
      std::chrono::milliseconds timeout = std::chrono::seconds(10),
      Cancellation* cancel = nullptr) const;

  // Each shard's digest of its slice of layer `layer` at `version`, in
  // `dtype` (nullopt: the policy's), in shard order (GetLayerDigest): what
  // bytes from anyone are checked against (wire::SliceDigestOf). A shard
  // computes it once per version, so the first asker may wait for a pass
  // over the shard's slice. Errors are the call's, naming the shard.
  absl::StatusOr<std::vector<layercast::v1::LayerDigest>> LayerDigests(
      uint32_t layer, uint64_t version, std::optional<DType> dtype,
      std::chrono::milliseconds timeout = kLayerTimeout) const;
  // DATA_LOSS naming the first shard whose slice of `bytes` (layer `layer`
  // at `version` in `dtype`, assembled in `layout`, from anyone) differs
  // from the SHA-256 that shard gives of it; ABORTED when `served_by` (per
  // shard, the incarnations the bytes came from; 0: not known) names
  // another start of a shard than the one answering (it restarted: pull
  // again); LayerDigests' errors.
  absl::Status CheckDigests(uint32_t layer, uint64_t version, std::optional<DType> dtype,
                            const AssembledLayout& layout, std::span<const uint8_t> bytes,
                            const std::vector<uint64_t>* served_by = nullptr) const;

  // The typed stub of shard `shard` (for PushGradients). REQUIRES: shard <
  // the number of shards.
  layercast::v1::ShardService::Stub& stub(uint32_t shard) const { return *stubs_[shard]; }
  // The connection to shard `shard` (for ShardAdmin calls). Same REQUIRES.
  const std::shared_ptr<grpc::Channel>& channel(uint32_t shard) const { return channels_[shard]; }

  // The worker library's metrics; nullptr without a registry.
  ClientMetrics* metrics() const override { return metrics_.get(); }

 private:
  ShardSet() = default;
  absl::Status CheckLayerIndex(uint32_t layer) const;
  // Shard `shard`'s WaitVersion answered at once (min_version 0).
  absl::StatusOr<layercast::v1::WaitVersionResponse> VersionNow(
      size_t shard, std::chrono::system_clock::time_point deadline,
      Cancellation* cancel = nullptr) const;
  absl::StatusOr<uint64_t> GatherStreams(uint32_t layer, const GatherOptions& options,
                                         std::span<uint8_t> buffer) const;

  std::vector<std::string> addresses_;
  bool tls_ = false;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<layercast::v1::ShardService::Stub>> stubs_;
  // FetchLayer goes through raw ByteBuffers (see ShardStream).
  std::vector<std::unique_ptr<grpc::GenericStub>> generic_stubs_;
  std::vector<layercast::v1::Manifest> manifests_;
  wire::ShardSetView view_;
  std::unique_ptr<ClientMetrics> metrics_;
};

// Splits "a:1,b:2" into addresses; INVALID_ARGUMENT on an empty entry.
absl::StatusOr<std::vector<std::string>> ParseShardList(absl::string_view list);

// Expands a pattern such as "layercast-{i}.layercast:7070" for i in
// 0..num_shards-1 (Kubernetes StatefulSet pod names). INVALID_ARGUMENT unless
// the pattern holds "{i}" and a port, and num_shards is 1-4096.
absl::StatusOr<std::vector<std::string>> ExpandShardPattern(absl::string_view pattern,
                                                            uint64_t num_shards);

// Why `address` could not be reached, in words, from gRPC's UNAVAILABLE
// message (which names the transport's last error), e.g. "connection
// refused: nothing listens at ..."; empty when it names no cause known here.
std::string UnreachableCause(const std::string& message, const std::string& address);

}  // namespace layercast::client
