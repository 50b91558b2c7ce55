#include "client/client_metrics.h"

namespace layercast::client {
namespace {

prometheus::Histogram::BucketBoundaries GatherBuckets() {
  prometheus::Histogram::BucketBoundaries buckets;
  for (double b = 0.001; b < 70; b *= 2) buckets.push_back(b);
  return buckets;
}

}  // namespace

ClientMetrics::ClientMetrics(prometheus::Registry& registry) {
  gather_duration_ = &prometheus::BuildHistogram()
                          .Name("layercast_client_gather_duration_seconds")
                          .Help("Duration of layer gathers from every shard, successful or not")
                          .Register(registry)
                          .Add({}, GatherBuckets());
  auto& gathers = prometheus::BuildCounter()
                      .Name("layercast_client_gathers_total")
                      .Help("Layer gathers by result (ok or error)")
                      .Register(registry);
  gathers_ok_ = &gathers.Add({{"result", "ok"}});
  gathers_failed_ = &gathers.Add({{"result", "error"}});
  received_bytes_ = &prometheus::BuildCounter()
                         .Name("layercast_client_received_bytes_total")
                         .Help("Assembled layer bytes gathered successfully")
                         .Register(registry)
                         .Add({});
  wait_seconds_ = &prometheus::BuildCounter()
                       .Name("layercast_client_wait_seconds_total")
                       .Help("Time callers spent blocked in LayerStream::Next waiting for a layer")
                       .Register(registry)
                       .Add({});
  auto& prefetch = prometheus::BuildCounter()
                       .Name("layercast_client_prefetch_total")
                       .Help("LayerStream::Next calls by whether the layer was already gathered")
                       .Register(registry);
  prefetch_hits_ = &prefetch.Add({{"result", "hit"}});
  prefetch_misses_ = &prefetch.Add({{"result", "miss"}});
  delta_fallbacks_ = &prometheus::BuildCounter()
                          .Name("layercast_client_delta_fallbacks_total")
                          .Help(
                              "Delta pulls the shards refused (they keep no changes, or none "
                              "back to the base) that were then gathered in full")
                          .Register(registry)
                          .Add({});
  version_skew_ = &prometheus::BuildGauge()
                       .Name("layercast_client_version_skew")
                       .Help(
                           "The highest minus the lowest parameter version the shards sent in "
                           "this worker's last gather (over its attempts): 0 while the set serves "
                           "one version")
                       .Register(registry)
                       .Add({});
  mirror_version_ = &prometheus::BuildGauge()
                         .Name("layercast_client_mirror_version")
                         .Help(
                             "The version every layer of this process's mirror holds (0 "
                             "before its first update)")
                         .Register(registry)
                         .Add({});
  mirror_lag_ = &prometheus::BuildGauge()
                     .Name("layercast_client_mirror_lag_versions")
                     .Help("The shards' version minus the mirror's, at its last update")
                     .Register(registry)
                     .Add({});
  mirror_pause_ = &prometheus::BuildHistogram()
                       .Name("layercast_client_mirror_pause_seconds")
                       .Help(
                           "How long each mirror update held readers off (its swap of the "
                           "staged layers, or its whole walk for layers it could not stage)")
                       .Register(registry)
                       .Add({}, GatherBuckets());
  mirror_staleness_ = &prometheus::BuildHistogram()
                           .Name("layercast_client_mirror_staleness_seconds")
                           .Help(
                               "From when a mirror learned of a new version to when its "
                               "readers could read it")
                           .Register(registry)
                           .Add({}, GatherBuckets());
  mirror_fallbacks_ = &prometheus::BuildCounter()
                           .Name("layercast_client_mirror_fallbacks_total")
                           .Help(
                               "Times this process's mirror left an upstream relay that died "
                               "for its fallback (the shards, or another relay)")
                           .Register(registry)
                           .Add({});
  auto& rereads = prometheus::BuildCounter()
                      .Name("layercast_client_rereads_total")
                      .Help(
                          "Reads done again because the bits under a version number changed "
                          "identity, by cause: shard_restarted (a shard's slice, after it "
                          "came back mid-gather as another incarnation), set_restarted (a "
                          "mirror's layer, after the set's numbers started again), "
                          "digest_mismatch (a mirror's layer whose bytes differed from the "
                          "shards' digests, pulled again from another source)")
                      .Register(registry);
  reread_shard_restarted_ = &rereads.Add({{"cause", "shard_restarted"}});
  reread_set_restarted_ = &rereads.Add({{"cause", "set_restarted"}});
  reread_digest_mismatch_ = &rereads.Add({{"cause", "digest_mismatch"}});
}

void ClientMetrics::RecordMirrorFallback() { mirror_fallbacks_->Increment(); }

void ClientMetrics::RecordReread(Reread cause, uint64_t count) {
  prometheus::Counter* counter = reread_digest_mismatch_;
  if (cause == Reread::kShardRestarted) counter = reread_shard_restarted_;
  if (cause == Reread::kSetRestarted) counter = reread_set_restarted_;
  counter->Increment(static_cast<double>(count));
}

void ClientMetrics::RecordMirrorUpdate(uint64_t version, uint64_t shards_version,
                                       double pause_seconds, double stale_seconds) {
  mirror_version_->Set(static_cast<double>(version));
  mirror_lag_->Set(static_cast<double>(shards_version > version ? shards_version - version : 0));
  mirror_pause_->Observe(pause_seconds);
  mirror_staleness_->Observe(stale_seconds);
}

void ClientMetrics::RecordVersionSkew(uint64_t skew) {
  version_skew_->Set(static_cast<double>(skew));
}

void ClientMetrics::RecordGather(bool ok, uint64_t bytes, double seconds) {
  gather_duration_->Observe(seconds);
  (ok ? gathers_ok_ : gathers_failed_)->Increment();
  if (ok) received_bytes_->Increment(static_cast<double>(bytes));
}

void ClientMetrics::RecordNext(bool hit, double seconds) {
  wait_seconds_->Increment(seconds);
  (hit ? prefetch_hits_ : prefetch_misses_)->Increment();
}

void ClientMetrics::RecordDeltaFallback() { delta_fallbacks_->Increment(); }

}  // namespace layercast::client
