#include "relay/relay.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "server/access/tls_credentials.h"

namespace layercast::relay {

absl::StatusOr<std::unique_ptr<Relay>> Relay::Start(const client::ShardSet& upstream,
                                                    RelayOptions options) {
  const size_t shards = upstream.manifests().size();
  if (options.listen.size() != shards) {
    return absl::InvalidArgumentError(
        absl::StrCat("a relay listens once per shard of the set, in shard order: give ", shards,
                     " addresses, not ", options.listen.size()));
  }
  for (const layercast::v1::Manifest& manifest : upstream.manifests()) {
    if (manifest.chunk_bytes() == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", manifest.shard_index(),
          " does not name its chunk size (Manifest.chunk_bytes), which a relay cuts the "
          "same chunks by: upgrade the shards"));
    }
  }
  std::vector<AssembledLayout> layouts = upstream.view().layouts;
  if (options.dtype) {
    for (AssembledLayout& layout : layouts) {
      ASSIGN_OR_RETURN(layout,
                       LayoutIn(layout, *options.dtype, upstream.view().policy.fp8_block()));
    }
  }
  layercast::v1::ShardConfig tls;
  tls.set_tls_cert_file(options.tls_cert_file);
  tls.set_tls_key_file(options.tls_key_file);
  tls.set_tls_client_ca_file(options.tls_client_ca_file);
  absl::StatusOr<server::ServerSecurity> security = server::ServerSecurityFor(tls);
  if (!security.ok()) {
    return absl::Status(security.status().code(),
                        absl::StrCat("the relay's own TLS (its --serve-tls-* files): ",
                                     security.status().message()));
  }
  std::unique_ptr<Relay> relay(new Relay(upstream, std::move(options), std::move(layouts)));
  if (!relay->options_.metrics_listen.empty()) {
    ASSIGN_OR_RETURN(relay->endpoint_,
                     server::MetricsEndpoint::Start(relay->options_.metrics_listen));
    relay->endpoint_->Register(relay->registry_);
    // The serving core's series (streams, refusals, stalls), as a shard's.
    relay->endpoint_->Register(relay->serving_->metrics.registry());
    const std::string& listen = relay->options_.metrics_listen;
    Log()->info("relay: metrics on {}:{}/metrics", listen.substr(0, listen.rfind(':')),
                relay->endpoint_->port());
  }
  for (uint32_t shard = 0; shard < shards; ++shard) {
    relay->services_.push_back(
        std::make_unique<RelayService>(relay->manifests_[shard], relay->view_, relay->layouts_,
                                       relay->versions_, relay->metrics_, *relay->serving_));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(relay->options_.listen[shard], security->credentials, &port);
    builder.RegisterService(relay->services_.back().get());
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (server == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen at ", relay->options_.listen[shard],
                                                 " for shard ", shard,
                                                 ": is the port taken, or the host not this one?"));
    }
    const std::string& listen = relay->options_.listen[shard];
    relay->addresses_.push_back(absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port));
    relay->servers_.push_back(std::move(server));
  }
  return relay;
}

namespace {

// The shards' manifests as a relay serves them. Given a dtype (--dtype), it
// names it (held_dtype) so that readers ask it for deltas in it, and lists
// every tensor as it is held, laid out as `held` (a pull in that dtype), so
// that what a reader sees is what it can read; `policy` and
// `layout_digest` stay the shards', which is how readers know the policy's
// dtypes and that this is their set.
std::vector<layercast::v1::Manifest> Served(std::vector<layercast::v1::Manifest> manifests,
                                            std::optional<DType> dtype,
                                            const std::vector<AssembledLayout>& held) {
  if (!dtype) return manifests;
  for (layercast::v1::Manifest& manifest : manifests) {
    manifest.set_held_dtype(static_cast<layercast::v1::DType>(*dtype));
    for (layercast::v1::Layer& layer : *manifest.mutable_layers()) {
      const AssembledLayout& layout = held[layer.index()];
      layer.set_assembled_bytes(layout.total_bytes());
      for (int t = 0; t < layer.tensors_size(); ++t) {
        const AssembledTensor& placed = layout.tensors()[t];
        layercast::v1::Tensor& tensor = *layer.mutable_tensors(t);
        tensor.set_compute_dtype(static_cast<layercast::v1::DType>(placed.compute_dtype));
        tensor.set_byte_offset(placed.byte_offset);
        tensor.set_block_size(placed.block_size);
        tensor.set_scale_offset(placed.scale_offset);
      }
    }
  }
  return manifests;
}

}  // namespace

Relay::Relay(const client::ShardSet& upstream, RelayOptions options,
             std::vector<AssembledLayout> layouts)
    : options_(std::move(options)),
      // `layouts`, not layouts_: members are built in declaration order.
      manifests_(Served(upstream.manifests(), options_.dtype, layouts)),
      view_(upstream.view()),
      layouts_(std::move(layouts)),
      serving_(
          std::make_unique<RelayServing>(options_.limits, static_cast<uint32_t>(layouts_.size()))),
      versions_(layouts_, options_.keep_versions),
      registry_(options_.registry ? options_.registry : std::make_shared<prometheus::Registry>()),
      metrics_(*registry_) {
  versions_.SetBudget(&serving_->budget);
}

Relay::~Relay() { Stop(); }

void Relay::Stop(std::chrono::milliseconds grace) {
  versions_.Close();
  serving_->Close();  // parked reads end at once, UNAVAILABLE
  const auto deadline = std::chrono::system_clock::now() + grace;
  for (const std::unique_ptr<grpc::Server>& server : servers_) server->Shutdown(deadline);
  for (const std::unique_ptr<grpc::Server>& server : servers_) server->Wait();
  servers_.clear();
}

void Relay::Pulling(uint64_t version) {
  versions_.Heading(version);
  serving_->Moved(versions_, std::nullopt);
  metrics_.SetVersions(versions_.held(), versions_.heading());
}

void Relay::Pulled(const PulledLayer& layer) {
  versions_.Put(layer.layer, layer.version, layer.changed, layer.bytes, *layer.incarnations);
  serving_->Moved(versions_, layer.layer);
  metrics_.RecordReceived(layer.received);
  metrics_.SetVersions(versions_.held(), versions_.heading());
}

}  // namespace layercast::relay
