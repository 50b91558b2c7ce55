#include "server/shard_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <prometheus/exposer.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "core/byte_size.h"
#include "core/safetensors_source.h"
#include "core/status_macros.h"
#include "core/synthetic_model.h"

namespace layercast::server {
namespace {

absl::StatusOr<std::unique_ptr<ParameterSource>> OpenSource(const ShardSettings& settings) {
  const auto& config = settings.config;
  if (!config.synthetic().empty()) {
    ASSIGN_OR_RETURN(auto synthetic, SyntheticModel::Create(config.synthetic()));
    return std::unique_ptr<ParameterSource>(std::move(synthetic));
  }
  ASSIGN_OR_RETURN(auto file,
                   SafetensorsSource::Open(config.model(), config.model_id(), settings.grouping));
  return std::unique_ptr<ParameterSource>(std::move(file));
}

// Keeps the "host:port" the user wrote, with the port gRPC picked for ":0".
std::string BoundAddress(const std::string& listen, int port) {
  const size_t colon = listen.rfind(':');
  return absl::StrCat(listen.substr(0, colon), ":", port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Create(ShardSettings settings) {
  auto server = std::unique_ptr<ShardServer>(new ShardServer(std::move(settings)));
  ASSIGN_OR_RETURN(server->source_, OpenSource(server->settings_));
  const auto& config = server->settings_.config;
  const ModelSpec& model = server->source_->model();
  if (model.layers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("model ", model.model_id, " has no layers"));
  }
  const uint64_t master =
      ParameterStore::MasterBytes(model, config.shard_index(), config.num_shards());
  const std::optional<uint64_t> budget = server->settings_.memory_budget_bytes;
  if (budget && master > *budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shard ", config.shard_index(), " of ", config.num_shards(), " needs ", FormatBytes(master),
        " (", master, " bytes) for its fp32 master parameters, but ", "--memory-budget is ",
        FormatBytes(*budget), " (", *budget, " bytes): raise the budget or use more shards"));
  }
  // One stream holds at most two chunks (see FetchLayerReactor::BufferBytes).
  const uint64_t one_stream = 2 * config.chunk_bytes();
  if (budget && *budget - master < one_stream) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "--memory-budget of ", FormatBytes(*budget), " leaves ", FormatBytes(*budget - master),
        " beside shard ", config.shard_index(), "'s fp32 master of ", FormatBytes(master),
        ", but one stream needs ", FormatBytes(one_stream), " (twice --chunk-bytes): raise the ",
        "budget or lower --chunk-bytes"));
  }
  server->service_ = std::make_unique<ShardService>(
      ShardService::Options{.chunk_bytes = config.chunk_bytes()}, server->metrics_);
  server->metrics_.master_bytes().Set(static_cast<double>(master));
  server->metrics_.memory_budget_bytes().Set(
      static_cast<double>(server->settings_.memory_budget_bytes.value_or(0)));
  return server;
}

absl::Status ShardServer::StartMetrics() {
  const std::string& listen = settings_.config.metrics_listen();
  if (listen.empty()) return absl::OkStatus();
  // prometheus-cpp reports a bind failure by throwing; this is its edge.
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/1);
  } catch (const std::exception& error) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen, ": ",
                                               error.what(), "; choose another --metrics-listen"));
  }
  exposer_->RegisterCollectable(metrics_.registry());
  const std::vector<int> ports = exposer_->GetListeningPorts();
  metrics_port_ = ports.empty() ? 0 : ports[0];
  std::fprintf(stderr, "layercast-shard %u/%u: metrics on %s/metrics\n",
               settings_.config.shard_index(), settings_.config.num_shards(),
               BoundAddress(listen, metrics_port_).c_str());
  return absl::OkStatus();
}

ShardServer::ShardServer(ShardSettings settings) : settings_(std::move(settings)) {}

ShardServer::~ShardServer() {
  if (server_ != nullptr) Shutdown(std::chrono::milliseconds(0));
}

absl::Status ShardServer::Start() {
  RETURN_IF_ERROR(StartMetrics());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(settings_.config.listen(), grpc::InsecureServerCredentials(), &port_);
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", settings_.config.listen(),
        ": the address is in use or not local; choose another --listen (port 0 picks a free one)"));
  }
  server_->GetHealthCheckService()->SetServingStatus(kReadinessService, false);
  const std::string address = BoundAddress(settings_.config.listen(), port_);
  std::fprintf(stderr, "layercast-shard %u/%u: listening on %s\n", settings_.config.shard_index(),
               settings_.config.num_shards(), address.c_str());
  if (!settings_.config.port_file().empty()) {
    // Written to a temporary name and renamed, so a reader never sees half.
    const std::string tmp = settings_.config.port_file() + ".tmp";
    std::ofstream(tmp) << port_ << "\n";
    if (std::rename(tmp.c_str(), settings_.config.port_file().c_str()) != 0) {
      return absl::InternalError(
          absl::StrCat("cannot write --port-file ", settings_.config.port_file()));
    }
  }
  return absl::OkStatus();
}

absl::Status ShardServer::Load(const std::atomic<bool>* cancel) {
  const auto& config = settings_.config;
  const auto started = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(store_, ParameterStore::Load(*source_, config.shard_index(), config.num_shards(),
                                                settings_.policy, cancel));
  budget_ = std::make_unique<MemoryBudget>(
      settings_.memory_budget_bytes, store_->master_bytes(),
      [this](uint64_t in_use, size_t waiting) {
        metrics_.memory_in_use_bytes().Set(static_cast<double>(in_use));
        metrics_.streams_waiting_for_budget().Set(static_cast<double>(waiting));
      });
  service_->AttachStore(store_.get(), budget_.get());
  server_->GetHealthCheckService()->SetServingStatus(kReadinessService, true);
  metrics_.ready().Set(1);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::fprintf(
      stderr,
      "layercast-shard %u/%u: loaded %s of fp32 master for %s (%zu layers) in %.2f s; ready\n",
      config.shard_index(), config.num_shards(), FormatBytes(store_->master_bytes()).c_str(),
      store_->model().model_id.c_str(), store_->model().layers.size(), seconds);
  return absl::OkStatus();
}

void ShardServer::Shutdown(std::chrono::milliseconds drain) {
  if (server_ == nullptr) return;
  // Refuse new streams with UNAVAILABLE (gRPC's own shutdown would answer
  // CANCELLED) and let the ones in flight finish; only then stop gRPC, which
  // cancels whatever the drain deadline left.
  service_->StartDraining();
  metrics_.ready().Set(0);
  server_->GetHealthCheckService()->SetServingStatus(kReadinessService, false);
  const bool drained = service_->WaitForStreams(absl::Now() + absl::FromChrono(drain));
  if (!drained) {
    std::fprintf(stderr,
                 "layercast-shard: drain timeout of %lld ms passed; cancelling %lld stream(s)\n",
                 static_cast<long long>(drain.count()),
                 static_cast<long long>(service_->streams_in_flight()));
  }
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  server_.reset();
}

}  // namespace layercast::server
