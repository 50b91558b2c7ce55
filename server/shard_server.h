#pragma once

#include <atomic>
#include <chrono>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "core/parameter_source.h"
#include "server/parameter_store.h"
#include "server/server_metrics.h"
#include "server/shard_config.h"
#include "server/shard_service.h"

namespace prometheus {
class Exposer;
}

namespace layercast::server {

// One shard server process's parts, in the order they come up: Create()
// checks everything that can fail without binding a port (config, model
// header, memory budget); Start() binds and serves health and reflection
// with readiness NOT_SERVING; Load() reads the shard's parameters and turns
// readiness SERVING; Shutdown() drains.
//
// Thread-safety: Shutdown() may be called from any thread once, concurrently
// with Load(); the other methods from one thread.
class ShardServer {
 public:
  // The health service name Kubernetes probes for readiness.
  static constexpr char kReadinessService[] = "layercast.v1.ShardService";

  static absl::StatusOr<std::unique_ptr<ShardServer>> Create(ShardSettings settings);
  ~ShardServer();

  // Binds `listen` (and `metrics_listen`, if set), starts serving, logs
  // "listening on HOST:PORT" (and "metrics on HOST:PORT") and writes the port
  // file. UNAVAILABLE if an address cannot be bound.
  absl::Status Start();

  // Loads this shard's parameters; CANCELLED if `*cancel` turns true first.
  absl::Status Load(const std::atomic<bool>* cancel);

  // Readiness NOT_SERVING, new streams refused with UNAVAILABLE, streams in
  // flight given until `drain` to finish (then cancelled); returns when the
  // server has stopped. Blocks the calling thread for up to `drain`.
  void Shutdown(std::chrono::milliseconds drain);

  int port() const { return port_; }
  // The metrics endpoint's port; 0 without one.
  int metrics_port() const { return metrics_port_; }
  ServerMetrics& metrics() { return metrics_; }
  const ShardSettings& settings() const { return settings_; }
  ShardService& service() { return *service_; }
  // The memory budget; nullptr until Load() is done.
  const MemoryBudget* budget() const { return budget_.get(); }

 private:
  explicit ShardServer(ShardSettings settings);

  absl::Status StartMetrics();

  ShardSettings settings_;
  ServerMetrics metrics_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int metrics_port_ = 0;
  std::unique_ptr<ParameterSource> source_;
  std::unique_ptr<ShardService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<MemoryBudget> budget_;
  int port_ = 0;
};

}  // namespace layercast::server
