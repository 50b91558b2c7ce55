#pragma once

#include <memory>
#include <string>

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>

#include "absl/status/statusor.h"

namespace layercast::server {

// The shard's Prometheus endpoint (prometheus-cpp's Exposer, which runs
// civetweb), stopped promptly. civetweb's accept loop polls its socket for up
// to 2 s before it sees that it should stop, and a scraper's keep-alive
// connection held a worker thread for longer: measured, every SIGTERM of a
// shard with --metrics-listen took 1.95 s after "stopped", and more while
// Prometheus was connected. Keep-alive is off (a scrape every 15 s gains
// nothing from it) and the destructor wakes the loop with a connection of its
// own, so the endpoint stops in milliseconds.
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
