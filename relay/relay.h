#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <prometheus/registry.h>

#include "absl/status/statusor.h"
#include "client/model_mirror.h"
#include "client/shard_set.h"
#include "relay/relay_metrics.h"
#include "relay/relay_service.h"
#include "relay/relayed_versions.h"
#include "server/serving/metrics_endpoint.h"

namespace layercast::relay {

struct RelayOptions {
  // Where each shard of the set is served, in shard order, host:port (port
  // 0 picks a free one: addresses() says which): one address per shard,
  // so a mirror connects to a relay as to the shards themselves.
  std::vector<std::string> listen;
  // Superseded versions of each layer kept beside the newest, for deltas
  // from them and pinned reads of them.
  uint32_t keep_versions = 2;
  // The shard's limits, on the relay's reads (RelayLimits).
  RelayLimits limits = RelayLimits::Defaults();
  // The layers as the relay's mirror holds them: the policy's dtypes, or
  // this one (MirrorOptions::dtype).
  std::optional<DType> dtype;
  // Where the relay's metrics go (a new registry if null), and where they
  // are served for Prometheus (none if empty), with whatever else the
  // caller registers there (its mirror's).
  std::shared_ptr<prometheus::Registry> registry;
  std::string metrics_listen;
  // TLS for what it serves, as a shard's --tls-cert-file, --tls-key-file
  // and --tls-client-ca-file (server/access/tls_credentials.h); plaintext when the
  // first two are empty.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
};

// Serves a shard set's reads from what a mirror of it holds, so a fleet
// feeds itself instead of every mirror pulling from the shards: given to a
// ModelMirror as its listener (MirrorOptions::listener), it serves each
// layer as it lands. To its readers it is the shard set itself: the same
// manifests, chunks, CRCs, versions and incarnations, one address per
// shard. A tree of relays (each following the one above, falling back to
// the shards when it dies) keeps the shards' egress one mirror's.
//
// Thread-safe.
class Relay final : public client::MirrorListener {
 public:
  // Listens for the set `upstream` is connected to. INVALID_ARGUMENT
  // unless `options.listen` has one address per shard, or naming a TLS
  // file that cannot be used; UNAVAILABLE naming an address (or
  // metrics_listen) that cannot be bound.
  static absl::StatusOr<std::unique_ptr<Relay>> Start(const client::ShardSet& upstream,
                                                      RelayOptions options);
  // Stop(), then waits for nothing more.
  ~Relay() override;

  // The bound addresses, in shard order.
  const std::vector<std::string>& addresses() const { return addresses_; }
  const RelayedVersions& versions() const { return versions_; }
  // Memory the relay's budget counts now: held versions (those streams
  // still send included) and stream buffers.
  uint64_t budgeted_bytes() const { return serving_->budget.in_use(); }

  // Refuses new calls and ends those in flight within `grace`.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(2000));

  void Pulling(uint64_t version) override;
  void Pulled(const PulledLayer& layer) override;

 private:
  Relay(const client::ShardSet& upstream, RelayOptions options,
        std::vector<AssembledLayout> layouts);

  const RelayOptions options_;
  const std::vector<layercast::v1::Manifest> manifests_;
  const wire::ShardSetView view_;
  const std::vector<AssembledLayout> layouts_;
  // Before the versions, whose buffers its budget counts, and the services
  // and servers that use it, so it outlives them.
  std::unique_ptr<RelayServing> serving_;
  RelayedVersions versions_;
  std::shared_ptr<prometheus::Registry> registry_;
  RelayMetrics metrics_;
  std::unique_ptr<server::MetricsEndpoint> endpoint_;
  std::vector<std::unique_ptr<RelayService>> services_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::string> addresses_;
};

}  // namespace layercast::relay
