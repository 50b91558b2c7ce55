#include "server/shard/shard_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "platform/file_system.h"
#include "platform/log.h"
#include "platform/status_macros.h"

// The shard's listening side: the gRPC server, the health port, the metrics
// endpoint, readiness and the port file. Loading and shutting down are in
// shard_server.cc, checkpoints in shard_server_checkpoints.cc.

namespace layercast::server {
namespace {

// Keeps the "host:port" the user wrote, with the port gRPC picked for ":0".
std::string BoundAddress(const std::string& listen, int port) {
  const size_t colon = listen.rfind(':');
  return absl::StrCat(listen.substr(0, colon), ":", port);
}

}  // namespace

absl::Status ShardServer::StartMetrics() {
  const std::string& listen = settings_.config.metrics_listen();
  if (listen.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(metrics_endpoint_, MetricsEndpoint::Start(listen));
  metrics_endpoint_->Register(metrics_.registry());
  metrics_endpoint_->Register(process_metrics_);
  metrics_port_ = metrics_endpoint_->port();
  Log()->info("metrics on {}/metrics", BoundAddress(listen, metrics_port_));
  return absl::OkStatus();
}

absl::Status ShardServer::StartHealth() {
  const std::string& listen = settings_.config.health_listen();
  if (listen.empty()) return absl::OkStatus();
  // A server of its own with no services: gRPC adds its default health
  // service (and reflection, which lists only that).
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &health_port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(settings_.config.max_receive_message_bytes()));
  // The health port is plaintext and open to whatever reaches the pod, and a
  // Watch stream lives until its client leaves: bound what clients can pile
  // up here. Probes make one call per connection.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 4);
  // All connections together: 4 MiB of gRPC buffers, and 2 threads for the
  // synchronous reflection service (health is callback-based and holds none).
  grpc::ResourceQuota quota("layercast-health");
  quota.Resize(4 << 20).SetMaxThreads(2);
  builder.SetResourceQuota(quota);
  // Idle connections close after 30 s, any connection after 5 min (10 s to
  // finish), ending the Watch streams it carried.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 30'000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, 300'000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, 10'000);
  health_server_ = builder.BuildAndStart();
  if (health_server_ == nullptr || health_port_ == 0) {
    health_server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot serve health on ", listen,
                                               ": the address is in use or not local; choose "
                                               "another --health-listen"));
  }
  health_server_->GetHealthCheckService()->SetServingStatus(kReadinessService, false);
  Log()->info("health on {} (plaintext)", BoundAddress(listen, health_port_));
  return absl::OkStatus();
}

void ShardServer::SetReadiness(bool serving) {
  server_->GetHealthCheckService()->SetServingStatus(kReadinessService, serving);
  if (health_server_ != nullptr) {
    health_server_->GetHealthCheckService()->SetServingStatus(kReadinessService, serving);
  }
}

absl::Status ShardServer::Start() {
  RETURN_IF_ERROR(StartMetrics());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  RETURN_IF_ERROR(StartHealth());
  const auto& config = settings_.config;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(config.listen(), security_.credentials, &port_);
  // Requests are a few dozen bytes: refuse big ones before parsing them.
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_receive_message_bytes()));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             static_cast<int>(config.max_concurrent_streams_per_connection()));
  // gRPC sets SO_REUSEPORT by default: a second shard on this port would
  // start beside the first and take half its connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // A dead peer's connection (and its streams) goes after an unanswered
  // ping; an idle one after max_connection_idle_ms. Workers may ping every
  // 10 s without being told off.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             static_cast<int>(config.keepalive_time_ms()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(config.max_connection_idle_ms()));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.RegisterService(service_.get());
  builder.RegisterService(admin_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    server_.reset();
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", settings_.config.listen(),
        ": the address is in use or not local; choose another --listen (port 0 picks a free one)"));
  }
  SetReadiness(false);
  const std::string address = BoundAddress(settings_.config.listen(), port_);
  Log()->info("listening on {} ({})", address,
              security_.mutual ? "mutual TLS"
              : security_.tls  ? "TLS"
                               : "plaintext");
  Log()->info("cast kernels: {}", SelectedCastIsa().Describe());
  if (!settings_.config.port_file().empty()) RETURN_IF_ERROR(WritePortFile());
  return absl::OkStatus();
}

absl::Status ShardServer::WritePortFile() {
  // Written to a fresh private file (never through a link planted at its
  // name) and renamed, so a reader never sees half.
  const std::string& path = settings_.config.port_file();
  const std::string tmp = absl::StrCat(path, ".tmp-", getpid());
  FileSystem& fs = DefaultFileSystem();
  (void)fs.Remove(tmp);  // a leftover of a crashed start with this pid
  const std::string text = absl::StrCat(port_, "\n");
  absl::StatusOr<std::unique_ptr<WritableFile>> file = fs.CreatePrivate(tmp);
  absl::Status written = file.status();
  if (written.ok()) {
    written = (*file)->Append(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  }
  if (written.ok()) written = (*file)->Close();
  if (written.ok()) written = fs.Rename(tmp, path);
  if (!written.ok()) {
    (void)fs.Remove(tmp);
    return absl::InternalError(
        absl::StrCat("cannot write --port-file ", path, ": ", written.message()));
  }
  return absl::OkStatus();
}

}  // namespace layercast::server
