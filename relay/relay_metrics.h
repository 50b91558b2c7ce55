#pragma once

#include <cstdint>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

namespace layercast::relay {

// A relay's Prometheus metrics (docs/metrics.md lists them), beside its
// mirror's layercast_client_mirror_* ones. Thread-safe.
class RelayMetrics {
 public:
  explicit RelayMetrics(prometheus::Registry& registry);

  // A stream to a child ended having sent `bytes` of chunks.
  void RecordServed(bool ok, uint64_t bytes);
  // The relay's mirror received `bytes` of chunks from its upstream.
  void RecordReceived(uint64_t bytes) { received_bytes_->Increment(static_cast<double>(bytes)); }
  // Every layer now holds `held`; the relay walks to `heading`.
  void SetVersions(uint64_t held, uint64_t heading);

 private:
  prometheus::Counter* served_bytes_;
  prometheus::Counter* streams_ok_;
  prometheus::Counter* streams_failed_;
  prometheus::Counter* received_bytes_;
  prometheus::Gauge* version_;
  prometheus::Gauge* heading_;
};

}  // namespace layercast::relay
