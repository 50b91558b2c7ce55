#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <array>
#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "core/cast_error.h"
#include "core/dtype.h"

namespace layercast::server {

// Every Prometheus metric a shard server exports, registered once, here, at
// start-up (prometheus-cpp throws on a bad name; a typo fails at start, never
// mid-request). docs/metrics.md describes each.
//
// Thread-safe: prometheus-cpp metrics are atomic and Family::Add locks.
class ServerMetrics {
 public:
  ServerMetrics();

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  // One RPC ended with gRPC status code `code` (e.g. "OK", "NOT_FOUND").
  void RecordRpc(absl::string_view method, absl::string_view code);
  // One FetchLayer stream that delivered data ended after `seconds`.
  void RecordFetchDuration(double seconds) { fetch_duration_->Observe(seconds); }
  // A chunk of `elements` in `dtype`, `bytes` of tensor data (an fp8
  // chunk's codes and block scales), reached the client.
  void RecordChunkSent(DType dtype, uint64_t elements, uint64_t bytes);
  // Casting `elements` fp32 values took `seconds`.
  void RecordCast(uint64_t elements, double seconds);
  // What casting a chunk of `layer` to `dtype` lost (core/cast_error.h), by
  // dtype and layer range (a label per eighth of the model, not per layer,
  // so a model of any depth has at most 8 ranges a dtype).
  void RecordCastError(uint64_t layer, DType dtype, const CastError& error);
  // Every series that sending layer `layer` in `dtype` adds to, at zero,
  // so that a dashboard of a fresh set shows zeros, not "No data". After
  // SetShardInfo (the layer ranges need the layer count).
  void PrepareSeries(uint64_t layer, DType dtype);
  // "0-9" for layer 3 of 80; the label RecordCastError files `layer` under.
  std::string LayerRange(uint64_t layer) const;

  // A chunk went out that was cast for its stream, or shared with another
  // stream that cast it (see SharedChunks).
  void RecordChunkCast() { chunks_cast_->Increment(); }
  void RecordChunkShared() { chunks_shared_->Increment(); }
  // A chunk went out from the cast cache (CastCache), cast by no stream.
  void RecordChunkCached() { chunks_cached_->Increment(); }
  // A stream was cancelled because its reader stopped draining chunks.
  void RecordStalledStream() { streams_stalled_->Increment(); }
  const prometheus::Counter& streams_stalled() const { return *streams_stalled_; }

  const prometheus::Counter& chunks_cast() const { return *chunks_cast_; }
  const prometheus::Counter& chunks_shared() const { return *chunks_shared_; }
  const prometheus::Counter& chunks_cached() const { return *chunks_cached_; }
  prometheus::Gauge& shared_chunk_bytes() { return *shared_chunk_bytes_; }
  prometheus::Gauge& cast_cache_bytes() { return *cast_cache_bytes_; }
  prometheus::Gauge& cast_cache_layers() { return *cast_cache_layers_; }
  prometheus::Gauge& streams_in_flight() { return *streams_in_flight_; }
  prometheus::Gauge& push_streams_in_flight() { return *push_streams_in_flight_; }
  prometheus::Gauge& streams_waiting_for_version() { return *streams_waiting_version_; }
  prometheus::Gauge& streams_waiting_for_budget() { return *streams_waiting_budget_; }
  prometheus::Gauge& memory_budget_bytes() { return *memory_budget_bytes_; }
  prometheus::Gauge& master_bytes() { return *master_bytes_; }
  prometheus::Gauge& memory_in_use_bytes() { return *memory_in_use_bytes_; }
  prometheus::Gauge& parameter_version() { return *parameter_version_; }
  prometheus::Gauge& ready() { return *ready_; }

  // Training (a shard with an optimizer). A PushGradients stream brought
  // `bytes` of gradient and was taken: staged, or it completed its layer's
  // step, which took `optimizer_seconds` and `step_seconds` since the step's
  // first push arrived.
  void RecordPushStaged(uint64_t bytes);
  void RecordPushApplied(uint64_t bytes, double optimizer_seconds, double step_seconds);
  // Bytes of gradient that arrived on a push that was not taken.
  void RecordPushRefused(uint64_t bytes) { gradient_bytes_->Increment(static_cast<double>(bytes)); }
  // `taken` records of the push journal were taken again at start.
  void RecordJournalReplayed(uint64_t taken) {
    journal_replayed_->Increment(static_cast<double>(taken));
  }
  // The push journal was damaged at start and --accept-journal-damage
  // replayed it up to the damage.
  void RecordJournalDamageAccepted() { journal_damage_->Increment(); }
  // The oldest open step (some workers pushed, some not): its missing
  // workers and how long it has waited (both 0 when none is open).
  prometheus::Gauge& step_missing_workers() { return *step_missing_workers_; }
  prometheus::Gauge& step_wait_seconds() { return *step_wait_seconds_; }

  // Publishing and delta pulls. A version of a layer changed `changed` of
  // its `elements` owned elements (in their compute dtype).
  void RecordVersionChange(uint64_t changed, uint64_t elements);
  // A delta chunk of `bytes` was sent where a full one would have been
  // `full_bytes`.
  void RecordDeltaChunk(uint64_t bytes, uint64_t full_bytes);
  // A publish committed: from begin to the commit's call, and the commit.
  void RecordPublish(double stage_seconds, double commit_seconds);
  // committed, aborted, settled_committed, settled_aborted or leveled.
  void RecordPublishOutcome(absl::string_view outcome);

  // Pinned reads (PinnedVersions). `result`: served or gone; `reason`:
  // no_room, evicted, expired or reclaimed.
  prometheus::Gauge& pinned_version_bytes() { return *pinned_version_bytes_; }
  prometheus::Gauge& pinned_versions() { return *pinned_versions_; }
  prometheus::Gauge& pinned_version_oldest_timestamp() { return *pinned_version_oldest_timestamp_; }
  prometheus::Gauge& pinned_readers() { return *pinned_readers_; }
  void RecordPinnedRead(absl::string_view result);
  void RecordPinnedVersionDropped(absl::string_view reason);

  // Sets layercast_shard_info and layercast_layers once the model is known.
  void SetShardInfo(const std::string& model_id, uint32_t shard_index, uint32_t num_shards,
                    const std::string& policy, uint64_t layers, uint64_t incarnation);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* rpcs_;
  prometheus::Family<prometheus::Counter>* sent_bytes_;
  prometheus::Counter* sent_parameters_;
  prometheus::Counter* cast_seconds_;
  prometheus::Counter* cast_input_bytes_;
  prometheus::Family<prometheus::Histogram>* cast_relative_error_;
  prometheus::Family<prometheus::Counter>* cast_lost_elements_;
  prometheus::Family<prometheus::Counter>* cast_unmeasured_elements_;
  std::atomic<uint64_t> layers_known_{0};  // from SetShardInfo, for LayerRange
  // sent_bytes_'s child of each dtype (by its number), resolved at the
  // dtype's first chunk: a chunk sent costs two atomic adds, not a lookup
  // by label map under the family's lock.
  std::array<std::atomic<prometheus::Counter*>, 8> sent_bytes_by_dtype_ = {};
  prometheus::Counter& SentBytes(DType dtype);
  prometheus::Counter* chunks_cast_;
  prometheus::Counter* chunks_shared_;
  prometheus::Counter* chunks_cached_;
  prometheus::Gauge* shared_chunk_bytes_;
  prometheus::Gauge* cast_cache_bytes_;
  prometheus::Gauge* cast_cache_layers_;
  prometheus::Histogram* fetch_duration_;
  prometheus::Gauge* streams_in_flight_;
  prometheus::Gauge* push_streams_in_flight_;
  prometheus::Gauge* streams_waiting_version_;
  prometheus::Counter* streams_stalled_;
  prometheus::Gauge* streams_waiting_budget_;
  prometheus::Gauge* memory_budget_bytes_;
  prometheus::Gauge* master_bytes_;
  prometheus::Gauge* memory_in_use_bytes_;
  prometheus::Gauge* parameter_version_;
  prometheus::Gauge* ready_;
  prometheus::Counter* gradient_bytes_;
  prometheus::Counter* pushes_staged_;
  prometheus::Counter* pushes_applied_;
  prometheus::Counter* journal_replayed_;
  prometheus::Counter* journal_damage_;
  prometheus::Histogram* optimizer_seconds_;
  prometheus::Histogram* step_seconds_;
  prometheus::Gauge* step_missing_workers_;
  prometheus::Gauge* step_wait_seconds_;
  prometheus::Counter* changed_elements_;
  prometheus::Counter* versioned_elements_;
  prometheus::Counter* delta_bytes_;
  prometheus::Counter* delta_full_bytes_;
  prometheus::Histogram* publish_stage_seconds_;
  prometheus::Histogram* publish_commit_seconds_;
  prometheus::Family<prometheus::Counter>* publish_outcomes_;
  prometheus::Gauge* pinned_version_bytes_;
  prometheus::Gauge* pinned_versions_;
  prometheus::Gauge* pinned_version_oldest_timestamp_;
  prometheus::Gauge* pinned_readers_;
  prometheus::Family<prometheus::Counter>* pinned_reads_;
  prometheus::Family<prometheus::Counter>* pinned_dropped_;
  prometheus::Family<prometheus::Gauge>* shard_info_;
  prometheus::Gauge* layers_;
};

}  // namespace layercast::server
