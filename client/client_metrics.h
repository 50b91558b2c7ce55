#pragma once

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

namespace layercast::client {

// The worker library's Prometheus metrics, registered once in the caller's
// registry (prometheus-cpp throws on a bad name; these names are fixed, so
// it cannot, but construction is the only place it could). docs/metrics.md
// describes each.
//
// Thread-safe.
class ClientMetrics {
 public:
  explicit ClientMetrics(prometheus::Registry& registry);

  // A gather of `bytes` ended (ok or not) after `seconds`.
  void RecordGather(bool ok, uint64_t bytes, double seconds);
  // The caller waited `seconds` in LayerStream::Next; `hit` when the layer
  // was already there.
  void RecordNext(bool hit, double seconds);
  // A delta pull was refused (a shard keeps no changes, or none back to its
  // base) and the layer was then gathered in full.
  void RecordDeltaFallback();
  // The shards sent versions up to `skew` apart in a gather's attempts.
  void RecordVersionSkew(uint64_t skew);
  // A mirror update made `version` readable: readers were held off for
  // `pause_seconds` (the swap), `stale_seconds` after the mirror learned
  // of the version; the shards were at `shards_version` then.
  void RecordMirrorUpdate(uint64_t version, uint64_t shards_version, double pause_seconds,
                          double stale_seconds);
  // A mirror's upstream relay died and it follows its fallback now.
  void RecordMirrorFallback();
  // Why bits were read again rather than kept or resumed
  // (layercast_client_rereads_total{cause}).
  enum class Reread {
    kShardRestarted,  // a shard's slice, after it came back mid-gather
    kSetRestarted,    // a mirror's layers, after the set's numbers started again
    kDigestMismatch,  // a mirror's layer whose bytes differed from the shards' digests
  };
  void RecordReread(Reread cause, uint64_t count = 1);

 private:
  prometheus::Histogram* gather_duration_;
  prometheus::Counter* gathers_ok_;
  prometheus::Counter* gathers_failed_;
  prometheus::Counter* received_bytes_;
  prometheus::Counter* wait_seconds_;
  prometheus::Counter* prefetch_hits_;
  prometheus::Counter* prefetch_misses_;
  prometheus::Counter* delta_fallbacks_;
  prometheus::Gauge* version_skew_;
  prometheus::Gauge* mirror_version_;
  prometheus::Gauge* mirror_lag_;
  prometheus::Histogram* mirror_pause_;
  prometheus::Histogram* mirror_staleness_;
  prometheus::Counter* mirror_fallbacks_;
  prometheus::Counter* reread_shard_restarted_;
  prometheus::Counter* reread_set_restarted_;
  prometheus::Counter* reread_digest_mismatch_;
};

}  // namespace layercast::client
