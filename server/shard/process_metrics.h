#pragma once

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <vector>

namespace layercast::server {

// The standard process metrics of Prometheus's client libraries, which
// prometheus-cpp does not provide, read from /proc/self at each scrape:
// process_resident_memory_bytes, process_virtual_memory_bytes,
// process_cpu_seconds_total, process_open_fds, process_max_fds and
// process_start_time_seconds. So a dashboard can set a shard's RSS against
// its budget (layercast_memory_in_use_bytes) and its container limit.
//
// Thread-safe: each Collect reads afresh.
class ProcessMetrics final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override;
};

}  // namespace layercast::server
