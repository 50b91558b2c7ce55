#include "relay/relay_metrics.h"

namespace layercast::relay {

RelayMetrics::RelayMetrics(prometheus::Registry& registry) {
  served_bytes_ = &prometheus::BuildCounter()
                       .Name("layercast_relay_served_bytes_total")
                       .Help("Chunk bytes this relay sent to the mirrors and relays below it")
                       .Register(registry)
                       .Add({});
  auto& streams = prometheus::BuildCounter()
                      .Name("layercast_relay_streams_total")
                      .Help("FetchLayer streams this relay answered, by how they ended")
                      .Register(registry);
  streams_ok_ = &streams.Add({{"result", "ok"}});
  streams_failed_ = &streams.Add({{"result", "failed"}});
  received_bytes_ = &prometheus::BuildCounter()
                         .Name("layercast_relay_received_bytes_total")
                         .Help("Chunk bytes this relay's mirror pulled from its upstream")
                         .Register(registry)
                         .Add({});
  version_ = &prometheus::BuildGauge()
                  .Name("layercast_relay_version")
                  .Help("The version every layer this relay serves holds")
                  .Register(registry)
                  .Add({});
  heading_ = &prometheus::BuildGauge()
                  .Name("layercast_relay_heading_version")
                  .Help(
                      "The version this relay's mirror walks to: its layers are served as they "
                      "land, so WaitVersion answers it")
                  .Register(registry)
                  .Add({});
}

void RelayMetrics::RecordServed(bool ok, uint64_t bytes) {
  served_bytes_->Increment(static_cast<double>(bytes));
  (ok ? streams_ok_ : streams_failed_)->Increment();
}

void RelayMetrics::SetVersions(uint64_t held, uint64_t heading) {
  version_->Set(static_cast<double>(held));
  heading_->Set(static_cast<double>(heading));
}

}  // namespace layercast::relay
