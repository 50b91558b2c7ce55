#include "server/serving/server_metrics.h"

#include <prometheus/histogram.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/build_info.h"
#include "wire/incarnation.h"

namespace layercast::server {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

// 1 ms to ~65 s in doublings: a small layer over loopback to a large one
// waiting on a busy shard.
prometheus::Histogram::BucketBoundaries FetchBuckets() {
  prometheus::Histogram::BucketBoundaries buckets;
  for (double b = 0.001; b < 70; b *= 2) buckets.push_back(b);
  return buckets;
}

// core/cast_error.h's bounds, 2^-24 to 2^-2: each dtype's rounding falls in
// a bucket of its own, and the top ones hold subnormals and flushed values.
prometheus::Histogram::BucketBoundaries RelativeErrorBuckets() {
  return {CastError::kBounds.begin(), CastError::kBounds.end()};
}

prometheus::Gauge* Gauge(prometheus::Registry& registry, const std::string& name,
                         const std::string& help) {
  return &BuildGauge().Name(name).Help(help).Register(registry).Add({});
}

}  // namespace

ServerMetrics::ServerMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  prometheus::Registry& r = *registry_;
  rpcs_ = &BuildCounter()
               .Name("layercast_rpcs_total")
               .Help("RPCs ended, by method and gRPC status code")
               .Register(r);
  // Every method's OK series from the start, so rates and ratios have a
  // series to work on before the first call (other codes appear as they
  // happen: gRPC has 17).
  for (const char* method : {"GetManifest", "FetchLayer", "PushGradients", "GetGradientNorm",
                             "ApplyClippedStep", "WaitVersion", "Checkpoint", "GetLayerDigest"}) {
    rpcs_->Add({{"method", method}, {"code", "OK"}});
  }
  sent_bytes_ = &BuildCounter()
                     .Name("layercast_sent_bytes_total")
                     .Help("Tensor bytes delivered to clients, by compute dtype")
                     .Register(r);
  sent_parameters_ = &BuildCounter()
                          .Name("layercast_sent_parameters_total")
                          .Help("Tensor elements delivered to clients")
                          .Register(r)
                          .Add({});
  cast_seconds_ = &BuildCounter()
                       .Name("layercast_cast_seconds_total")
                       .Help("Time spent casting fp32 masters into outgoing chunks")
                       .Register(r)
                       .Add({});
  cast_input_bytes_ = &BuildCounter()
                           .Name("layercast_cast_input_bytes_total")
                           .Help(
                               "fp32 master bytes read by casts (rate over "
                               "layercast_cast_seconds_total: cast throughput)")
                           .Register(r)
                           .Add({});
  cast_relative_error_ = &BuildHistogram()
                              .Name("layercast_cast_relative_error")
                              .Help(
                                  "Relative error |cast - x| / |x| of finite, nonzero elements "
                                  "cast to a narrower dtype, by dtype and layer range: every "
                                  "element that overflowed, was flushed or became subnormal, "
                                  "and a deterministic sample of the rest, one in "
                                  "--cast-error-sample-every vectors of 16 (the others are "
                                  "layercast_cast_unmeasured_elements_total)")
                              .Register(r);
  cast_unmeasured_elements_ =
      &BuildCounter()
           .Name("layercast_cast_unmeasured_elements_total")
           .Help(
               "Elements cast to a normal value of a narrower dtype (a relative error of at most "
               "its unit roundoff) whose error is outside the measured sample "
               "(--cast-error-sample-every), by dtype and layer range: nonzero means "
               "layercast_cast_relative_error describes a sample")
           .Register(r);
  cast_lost_elements_ = &BuildCounter()
                             .Name("layercast_cast_lost_elements_total")
                             .Help(
                                 "Elements a cast overflowed (to inf or saturated), flushed to "
                                 "zero, or made subnormal, by dtype, layer range and how")
                             .Register(r);
  auto& chunk_sources = BuildCounter()
                            .Name("layercast_chunks_total")
                            .Help(
                                "Chunks sent, by source: cast for the stream, shared with "
                                "another stream that cast it, or from the cast cache")
                            .Register(r);
  chunks_cast_ = &chunk_sources.Add({{"source", "cast"}});
  chunks_shared_ = &chunk_sources.Add({{"source", "shared"}});
  chunks_cached_ = &chunk_sources.Add({{"source", "cache"}});
  shared_chunk_bytes_ =
      Gauge(r, "layercast_shared_chunk_bytes",
            "Bytes of cast chunks kept for other streams to send (part of memory in use)");
  cast_cache_bytes_ = Gauge(r, "layercast_cast_cache_bytes",
                            "Bytes of compute-dtype layers the cast cache holds for later reads "
                            "(--cast-cache-bytes; part of memory in use)");
  cast_cache_layers_ =
      Gauge(r, "layercast_cast_cache_layers", "Layers the cast cache holds for later reads");
  fetch_duration_ = &BuildHistogram()
                         .Name("layercast_fetch_duration_seconds")
                         .Help("Duration of FetchLayer streams that ended OK, start to last chunk")
                         .Register(r)
                         .Add({}, FetchBuckets());
  streams_in_flight_ = Gauge(r, "layercast_streams_in_flight", "FetchLayer streams open now");
  push_streams_in_flight_ = Gauge(r, "layercast_push_streams_in_flight",
                                  "PushGradients streams open now (at most --max-push-streams)");
  streams_waiting_version_ =
      Gauge(r, "layercast_streams_waiting_for_version",
            "Streams parked until the parameter version reaches min_version");
  streams_stalled_ = &BuildCounter()
                          .Name("layercast_streams_stalled_total")
                          .Help(
                              "Streams cancelled because the client did not drain a chunk "
                              "(FetchLayer) or send one (PushGradients) within "
                              "--write-progress-timeout-ms")
                          .Register(r)
                          .Add({});
  streams_waiting_budget_ = Gauge(r, "layercast_streams_waiting_for_budget",
                                  "Streams waiting for memory budget to start");
  memory_budget_bytes_ =
      Gauge(r, "layercast_memory_budget_bytes", "The server's memory budget (0: unlimited)");
  master_bytes_ = Gauge(r, "layercast_master_bytes", "Bytes of fp32 master parameters held");
  memory_in_use_bytes_ =
      Gauge(r, "layercast_memory_in_use_bytes",
            "Budgeted bytes in use: master, chunk buffers in flight and shared chunks");
  parameter_version_ =
      Gauge(r, "layercast_parameter_version", "Optimizer steps applied to the master parameters");
  ready_ = Gauge(r, "layercast_ready", "1 when parameters are loaded and the shard serves");
  gradient_bytes_ = &BuildCounter()
                         .Name("layercast_gradient_bytes_received_total")
                         .Help("Bytes of gradient data received by PushGradients, taken or not")
                         .Register(r)
                         .Add({});
  auto& pushes = BuildCounter()
                     .Name("layercast_gradient_pushes_total")
                     .Help(
                         "PushGradients streams taken, by result: staged (waiting for other "
                         "workers) or applied (completed the layer's optimizer step); refused "
                         "ones are in layercast_rpcs_total by code")
                     .Register(r);
  pushes_staged_ = &pushes.Add({{"result", "staged"}});
  pushes_applied_ = &pushes.Add({{"result", "applied"}});
  journal_replayed_ = &BuildCounter()
                           .Name("layercast_push_journal_replayed_total")
                           .Help(
                               "Pushes and clip scales a training shard took again from its push "
                               "journal when it started (a restart after a death)")
                           .Register(r)
                           .Add({});
  journal_damage_ = &BuildCounter()
                         .Name("layercast_push_journal_damage_total")
                         .Help(
                             "Damaged push journals a training shard started over anyway "
                             "(--accept-journal-damage): acknowledged pushes after the damage "
                             "were lost")
                         .Register(r)
                         .Add({});
  optimizer_seconds_ = &BuildHistogram()
                            .Name("layercast_optimizer_step_seconds")
                            .Help("Time to average a layer's gradients and step its optimizer")
                            .Register(r)
                            .Add({}, FetchBuckets());
  step_seconds_ = &BuildHistogram()
                       .Name("layercast_layer_step_seconds")
                       .Help("From a layer step's first gradient push to the step applied")
                       .Register(r)
                       .Add({}, FetchBuckets());
  step_missing_workers_ =
      Gauge(r, "layercast_step_missing_workers",
            "Workers whose push the oldest open layer step still waits for (0: none open)");
  step_wait_seconds_ = Gauge(r, "layercast_step_wait_seconds",
                             "How long the oldest open layer step has waited for its last push");
  auto& changes = BuildCounter()
                      .Name("layercast_version_elements_total")
                      .Help(
                          "Owned elements of layers whose master changed (an optimizer step "
                          "or a publish), by whether their compute-dtype value changed: "
                          "changed / all is the share a delta pull sends")
                      .Register(r);
  changed_elements_ = &changes.Add({{"kind", "changed"}});
  versioned_elements_ = &changes.Add({{"kind", "all"}});
  auto& delta = BuildCounter()
                    .Name("layercast_delta_bytes_total")
                    .Help(
                        "Delta pulls: bytes of delta chunks sent (kind=delta) and what full "
                        "chunks of the same elements would have been (kind=full)")
                    .Register(r);
  delta_bytes_ = &delta.Add({{"kind", "delta"}});
  delta_full_bytes_ = &delta.Add({{"kind", "full"}});
  auto& publish = BuildHistogram()
                      .Name("layercast_publish_seconds")
                      .Help(
                          "Committed publishes by phase: stage (from BeginPublish to "
                          "CommitPublish) and commit (copying into the master)")
                      .Register(r);
  publish_stage_seconds_ = &publish.Add({{"phase", "stage"}}, FetchBuckets());
  publish_commit_seconds_ = &publish.Add({{"phase", "commit"}}, FetchBuckets());
  publish_outcomes_ = &BuildCounter()
                           .Name("layercast_publishes_total")
                           .Help(
                               "Publishes this shard finished, by outcome: committed (by its "
                               "publisher or handed on by shard 0), aborted (by the publisher, "
                               "or at its timeout without peers), settled_committed and "
                               "settled_aborted (a publish whose publisher stopped, settled with "
                               "the set), leveled (a commit that brought a shard behind the set "
                               "to its version)")
                           .Register(r);
  // Every outcome from the start, at zero: rate() and alerts see the first.
  for (const char* outcome :
       {"committed", "aborted", "settled_committed", "settled_aborted", "leveled"}) {
    publish_outcomes_->Add({{"outcome", outcome}});
  }
  pinned_version_bytes_ = Gauge(r, "layercast_pinned_version_bytes",
                                "Bytes of layer versions kept for pinned readers (part of memory "
                                "in use)");
  pinned_versions_ = Gauge(r, "layercast_pinned_versions",
                           "Layer versions kept for pinned readers (one per layer and version)");
  pinned_version_oldest_timestamp_ =
      Gauge(r, "layercast_pinned_version_oldest_timestamp_seconds",
            "Unix time when the oldest kept layer version was superseded (0: none kept); "
            "time() minus it is the age of the oldest version pinned readers can still get");
  pinned_readers_ = Gauge(r, "layercast_pinned_readers",
                          "FetchLayer streams open at a version their layer has moved past");
  pinned_reads_ = &BuildCounter()
                       .Name("layercast_pinned_reads_total")
                       .Help(
                           "FetchLayer streams at a version their layer had moved past: served "
                           "from a kept version (result=served), or refused with ABORTED "
                           "because it was no longer kept (result=gone)")
                       .Register(r);
  pinned_dropped_ =
      &BuildCounter()
           .Name("layercast_pinned_versions_dropped_total")
           .Help(
               "Layer versions not kept or no longer kept: no_room (the budget had "
               "no room when the layer changed), evicted (a layer's --pin-versions "
               "newest unleased are kept), expired (--pin-retention-ms passed), reclaimed (a "
               "stream needed the memory)")
           .Register(r);
  for (const char* result : {"served", "gone"}) pinned_reads_->Add({{"result", result}});
  for (const char* reason : {"no_room", "evicted", "expired", "reclaimed"}) {
    pinned_dropped_->Add({{"reason", reason}});
  }
  shard_info_ = &BuildGauge()
                     .Name("layercast_shard_info")
                     .Help("Always 1; labels describe the shard and its model")
                     .Register(r);
  layers_ = Gauge(r, "layercast_layers", "Layers in the model");
  const BuildInfo build = GetBuildInfo();
  BuildGauge()
      .Name("layercast_build_info")
      .Help("Always 1; the labels say what was built and which cast kernel this CPU runs")
      .Register(r)
      .Add({{"version", build.version},
            {"commit", build.git_commit},
            {"cast_kernel", build.cast_kernel}})
      .Set(1);
}

void ServerMetrics::RecordRpc(absl::string_view method, absl::string_view code) {
  rpcs_->Add({{"method", std::string(method)}, {"code", std::string(code)}}).Increment();
}

prometheus::Counter& ServerMetrics::SentBytes(DType dtype) {
  std::atomic<prometheus::Counter*>& slot =
      sent_bytes_by_dtype_[static_cast<size_t>(dtype) % sent_bytes_by_dtype_.size()];
  prometheus::Counter* counter = slot.load(std::memory_order_acquire);
  if (counter == nullptr) {
    // Two threads may both get here: Add gives both the same child.
    counter = &sent_bytes_->Add({{"dtype", std::string(DTypeName(dtype))}});
    slot.store(counter, std::memory_order_release);
  }
  return *counter;
}

void ServerMetrics::RecordChunkSent(DType dtype, uint64_t elements, uint64_t bytes) {
  SentBytes(dtype).Increment(static_cast<double>(bytes));
  sent_parameters_->Increment(static_cast<double>(elements));
}

void ServerMetrics::RecordCast(uint64_t elements, double seconds) {
  cast_seconds_->Increment(seconds);
  cast_input_bytes_->Increment(static_cast<double>(elements * sizeof(float)));
}

std::string ServerMetrics::LayerRange(uint64_t layer) const {
  const uint64_t layers = layers_known_.load(std::memory_order_relaxed);
  if (layers == 0) return std::to_string(layer);
  const uint64_t span = (layers + 7) / 8;
  const uint64_t first = layer / span * span;
  const uint64_t last = std::min(layers, first + span) - 1;
  return first == last ? std::to_string(first) : absl::StrCat(first, "-", last);
}

void ServerMetrics::PrepareSeries(uint64_t layer, DType dtype) {
  sent_bytes_->Add({{"dtype", std::string(DTypeName(dtype))}});
  // Nothing cast yet: every cast-error series of the layer, at zero.
  RecordCastError(layer, dtype, CastError{});
}

void ServerMetrics::RecordCastError(uint64_t layer, DType dtype, const CastError& error) {
  if (dtype == DType::kFloat32) return;  // a copy: nothing lost
  const prometheus::Labels labels = {{"dtype", std::string(DTypeName(dtype))},
                                     {"layers", LayerRange(layer)}};
  // Prometheus wants each bucket's own count; CastError counts how many
  // exceed each bound.
  std::vector<double> increments(CastError::kBuckets + 1);
  increments[0] = static_cast<double>(error.measured - error.above[0]);
  for (int k = 1; k < CastError::kBuckets; ++k) {
    increments[k] = static_cast<double>(error.above[k - 1] - error.above[k]);
  }
  increments[CastError::kBuckets] = static_cast<double>(error.above[CastError::kBuckets - 1]);
  cast_relative_error_->Add(labels, RelativeErrorBuckets())
      .ObserveMultiple(increments, error.relative_error_sum);
  cast_unmeasured_elements_->Add(labels).Increment(static_cast<double>(error.unmeasured));
  for (const auto& [how, count] : {std::pair{"overflowed", error.overflowed},
                                   std::pair{"flushed_to_zero", error.flushed_to_zero},
                                   std::pair{"became_subnormal", error.became_subnormal}}) {
    prometheus::Labels with_how = labels;
    with_how.emplace("how", how);
    // Added even at zero, so every series exists once its dtype was cast.
    cast_lost_elements_->Add(with_how).Increment(static_cast<double>(count));
  }
}

void ServerMetrics::RecordPushStaged(uint64_t bytes) {
  gradient_bytes_->Increment(static_cast<double>(bytes));
  pushes_staged_->Increment();
}

void ServerMetrics::RecordPushApplied(uint64_t bytes, double optimizer_seconds,
                                      double step_seconds) {
  gradient_bytes_->Increment(static_cast<double>(bytes));
  pushes_applied_->Increment();
  optimizer_seconds_->Observe(optimizer_seconds);
  step_seconds_->Observe(step_seconds);
}

void ServerMetrics::SetShardInfo(const std::string& model_id, uint32_t shard_index,
                                 uint32_t num_shards, const std::string& policy, uint64_t layers,
                                 uint64_t incarnation) {
  shard_info_
      ->Add({{"model_id", model_id},
             {"shard_index", std::to_string(shard_index)},
             {"num_shards", std::to_string(num_shards)},
             {"policy", policy},
             {"incarnation", wire::IncarnationName(incarnation)}})
      .Set(1);
  layers_->Set(static_cast<double>(layers));
  layers_known_.store(layers, std::memory_order_relaxed);
}

void ServerMetrics::RecordVersionChange(uint64_t changed, uint64_t elements) {
  changed_elements_->Increment(static_cast<double>(changed));
  versioned_elements_->Increment(static_cast<double>(elements));
}

void ServerMetrics::RecordDeltaChunk(uint64_t bytes, uint64_t full_bytes) {
  delta_bytes_->Increment(static_cast<double>(bytes));
  delta_full_bytes_->Increment(static_cast<double>(full_bytes));
}

void ServerMetrics::RecordPublish(double stage_seconds, double commit_seconds) {
  publish_stage_seconds_->Observe(stage_seconds);
  publish_commit_seconds_->Observe(commit_seconds);
}

void ServerMetrics::RecordPublishOutcome(absl::string_view outcome) {
  publish_outcomes_->Add({{"outcome", std::string(outcome)}}).Increment();
}

void ServerMetrics::RecordPinnedRead(absl::string_view result) {
  pinned_reads_->Add({{"result", std::string(result)}}).Increment();
}

void ServerMetrics::RecordPinnedVersionDropped(absl::string_view reason) {
  pinned_dropped_->Add({{"reason", std::string(reason)}}).Increment();
}

}  // namespace layercast::server
