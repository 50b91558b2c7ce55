#pragma once

#include <memory>
#include <string>

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>

#include "absl/status/statusor.h"

namespace layercast::server {

// The shard's Prometheus endpoint (prometheus-cpp's Exposer, which runs
// civetweb), stopped promptly. civetweb's accept loop polls its socket for up
// to 2 s between looks at its stop flag: measured, every SIGTERM of a shard
// with --metrics-listen took 1.95 s after "stopped". The destructor wakes the
// loop with connections of its own while the Exposer stops, so the endpoint
// stops in milliseconds.
//
// Not thread-safe: made, registered with and destroyed by the shard's
// start-up and shutdown, on one thread.
class MetricsEndpoint {
 public:
  // UNAVAILABLE naming `listen` when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& listen);
  ~MetricsEndpoint();

  void Register(const std::weak_ptr<prometheus::Collectable>& collectable);
  int port() const { return port_; }

 private:
  MetricsEndpoint() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string host_;
  int port_ = 0;
};

}  // namespace layercast::server
