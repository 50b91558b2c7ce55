#include "client/layer_gather.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "wire/incarnation.h"
#include "wire/owned_runs.h"

namespace layercast::client {
namespace {

// CANCELLED reaches a gather that did not cancel only from the shard: its
// gRPC server cancels what its drain left when it stops. Not gRPC's retry
// policy: a resumed stream asks for another range, and a restart takes
// longer than its 5 attempts can wait.
bool Retryable(const absl::Status& status) { return platform::kGatherStream.Retries(status); }

}  // namespace

LayerGather::LayerGather(std::vector<Shard> shards, const AssembledLayout& layout, uint32_t layer,
                         const GatherOptions& options, std::span<uint8_t> buffer,
                         uint64_t default_version)
    : shards_(std::move(shards)),
      layout_(layout),
      layer_(layer),
      options_(options),
      buffer_(buffer),
      default_version_(default_version) {}

std::vector<ShardStream::Run> LayerGather::OwnedRuns(uint32_t shard) const {
  std::vector<ShardStream::Run> runs;
  const uint32_t n = static_cast<uint32_t>(shards_.size());
  for (const TensorElementRange& owned : wire::OwnedRuns(layout_, selected_, shard, n)) {
    const AssembledTensor& placed = layout_.tensors()[owned.tensor];
    runs.push_back(ShardStream::Run{owned.tensor, owned.elements, placed.byte_offset,
                                    DTypeSize(placed.compute_dtype), placed.block_size,
                                    placed.scale_offset});
  }
  return runs;
}

layercast::v1::FetchLayerRequest LayerGather::RequestFor(uint32_t shard,
                                                         const std::vector<ShardStream::Run>& runs,
                                                         bool resume, bool recast) const {
  layercast::v1::FetchLayerRequest request;
  request.set_layer(layer_);
  request.set_min_version(options_.min_version);
  request.set_expect_content_fingerprint(shards_[shard].content_fingerprint);
  request.set_recast(recast);
  if (options_.dtype) request.set_dtype(static_cast<layercast::v1::DType>(*options_.dtype));
  if (options_.base_version) {
    request.set_base_version(*options_.base_version);
    request.set_accepts_changed_gaps(options_.changed_gaps);
    if (shard < options_.base_incarnations.size() && options_.base_incarnations[shard] != 0) {
      request.set_base_incarnation(options_.base_incarnations[shard]);
    }
  }
  if (options_.exact_version) request.set_exact_version(*options_.exact_version);
  request.set_will_pull_deltas(options_.will_pull_deltas);
  // A resumed stream asks for the range from its first missing element: the
  // shard sends what it owns of a range, so that is exactly the runs still
  // owed.
  const uint64_t begin = resume && !runs.empty()
                             ? runs[0].byte_offset + runs[0].elements.begin * runs[0].element_size
                             : range_begin_;
  if (begin != 0 || range_end_ != layout_.total_bytes()) {
    request.set_range_begin(begin);
    request.set_range_end(range_end_);
  }
  return request;
}

void LayerGather::Start(uint32_t shard) {
  ShardState& s = state_[shard];
  s.retry_at.reset();
  ++s.attempts;
  ++active_;
  s.stream = std::make_unique<ShardStream>(
      shards_[shard].describe, s.runs, buffer_,
      [this, shard] {
        absl::MutexLock lock(&mu_);
        finished_.push_back(shard);
      },
      options_.on_chunk, options_.base_version);
  s.stream->Start(*shards_[shard].stub,
                  RequestFor(shard, s.runs, /*resume=*/s.attempts > 1,
                             // after a checksum failure, not the kept copy again
                             /*recast=*/absl::IsDataLoss(s.last_error)),
                  deadline_);
}

void LayerGather::CancelAll() {
  for (ShardState& s : state_) {
    if (s.stream != nullptr) s.stream->Cancel();
    s.retry_at.reset();
  }
}

void LayerGather::Settle(uint32_t shard) {
  ShardState& s = state_[shard];
  --active_;
  if (options_.changed_elements != nullptr) {
    *options_.changed_elements += s.stream->changed_elements();
  }
  // One place decides that a gather never mixes versions: every stream of
  // every shard and attempt must match the first version any stream sent.
  const std::optional<uint64_t> version = s.stream->version();
  // Which incarnation served: known from a stream that delivered, or that
  // ended well with nothing to send (a delta of an unchanged slice).
  if (const std::optional<uint64_t> incarnation = s.stream->incarnation();
      incarnation && (version || s.stream->status().ok())) {
    const uint64_t at = version.value_or(options_.exact_version.value_or(options_.min_version));
    if (options_.pinned_identity != nullptr) {
      if (absl::Status same =
              options_.pinned_identity->Check(shard, *incarnation, at, shards_[shard].describe);
          !same.ok()) {
        if (failure_.ok()) failure_ = same;
        CancelAll();
        return;
      }
    }
    if (s.incarnation != 0 && *incarnation != s.incarnation) {
      // The shard restarted mid-gather: a number names bits only within
      // one incarnation (a publish may have given it other values), so
      // what the earlier incarnation sent is not resumed from.
      ReadAgain(shard, *incarnation, at);
      return;
    }
    s.incarnation = *incarnation;
  }
  if (version) {
    newest_version_ = std::max(newest_version_, *version);
    oldest_version_ = std::min(oldest_version_, *version);
    if (version_ && *version != *version_) {
      if (failure_.ok()) {
        failure_ = absl::AbortedError(absl::StrCat(
            shards_[shard].describe, " sent parameter version ", *version,
            " where the rest of the layer is version ", *version_,
            " (the shards' versions moved during the gather); gather it again with min_version ",
            std::max(*version, *version_)));
      }
      CancelAll();
      return;
    }
    version_ = version;
  }
  s.runs = s.stream->RemainingRuns();
  // Settled by what it delivered: a stream that ended badly after its last
  // chunk owes nothing, and asking again would ask for the whole range.
  if (s.runs.empty()) return;
  const absl::Status status = s.stream->status();
  if (status.ok()) return;
  s.last_error = status;
  if (!failure_.ok() || cancelled_) return;  // already failing: just count it out
  const auto now = std::chrono::steady_clock::now();
  const auto delay = s.backoff.Next();
  const bool time_left = std::chrono::system_clock::now() + delay < deadline_;
  if (Retryable(status) && time_left && s.attempts < platform::kGatherStream.max_attempts) {
    s.retry_at = now + delay;
    Log()->warn("gathering layer {}: {}; retrying in {} ms", layer_, status.message(),
                delay.count());
    if (options_.on_retry) options_.on_retry(status, delay);
    return;
  }
  const ShardState* cause = &s;
  if (absl::IsDeadlineExceeded(status)) {
    // A stream that waited out the deadline (for a version) while another
    // shard could not be reached: that shard is the cause, and is named.
    for (const ShardState& other : state_) {
      if (&other != &s && !other.runs.empty() && !other.last_error.ok() &&
          Retryable(other.last_error)) {
        cause = &other;
      }
    }
  }
  const absl::Status& error = cause->last_error;
  failure_ = absl::Status(
      error.code(),
      absl::StrCat(
          error.message(),
          Retryable(error)
              ? absl::StrCat(" (gave up after ", cause->attempts,
                             " attempt(s): the gather's deadline of ", options_.timeout.count(),
                             " ms came; raise it to wait longer for a restarting shard)")
              : ""));
  CancelAll();
}

void LayerGather::ReadAgain(uint32_t shard, uint64_t incarnation, uint64_t version) {
  ShardState& s = state_[shard];
  if (!failure_.ok() || cancelled_) {  // ending already: nothing more to start
    s.incarnation = incarnation;
    return;
  }
  const std::string what =
      absl::StrCat(shards_[shard].describe, " restarted mid-gather (incarnation ",
                   wire::IncarnationName(s.incarnation), " sent part of its slice, incarnation ",
                   wire::IncarnationName(incarnation), " version ", version, " the rest)");
  if (options_.base_version) {
    // Deltas were applied in place from the old incarnation's numbering:
    // the caller's base no longer names these bits, so it pulls in full.
    if (failure_.ok()) {
      failure_ = absl::OutOfRangeError(
          absl::StrCat(what, ": the delta's base names other bits there; pull in full"));
    }
    CancelAll();
    return;
  }
  Log()->warn("gathering layer {}: {}; reading its whole slice again from the new incarnation",
              layer_, what);
  ++rereads_;
  s.incarnation = incarnation;
  s.runs = OwnedRuns(shard);
  s.attempts = 0;  // a fresh read, not a resumption
  s.last_error = absl::OkStatus();
  s.retry_at = std::chrono::steady_clock::now();
}

uint64_t LayerGather::rereads() const {
  absl::MutexLock lock(&mu_);
  return rereads_;
}

uint64_t LayerGather::newest_version() const {
  absl::MutexLock lock(&mu_);
  return newest_version_;
}

uint64_t LayerGather::version_skew() const {
  absl::MutexLock lock(&mu_);
  return oldest_version_ == UINT64_MAX ? 0 : newest_version_ - oldest_version_;
}

absl::StatusOr<uint64_t> LayerGather::Run() {
  const uint64_t total = layout_.total_bytes();
  std::tie(range_begin_, range_end_) =
      options_.byte_range.value_or(std::make_pair(uint64_t{0}, total));
  if (total == 0) return default_version_;
  ASSIGN_OR_RETURN(selected_, layout_.MapByteRange(range_begin_, range_end_));
  deadline_ = std::chrono::system_clock::now() + options_.timeout;

  uint64_t cancel_id = 0;
  {
    absl::MutexLock lock(&mu_);
    state_.resize(shards_.size());
    for (uint32_t shard = 0; shard < shards_.size(); ++shard) {
      state_[shard].runs = OwnedRuns(shard);
      Start(shard);
    }
  }
  if (options_.cancellation != nullptr) {
    cancel_id = options_.cancellation->Register([this] {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      CancelAll();
    });
  }

  {
    absl::MutexLock lock(&mu_);
    while (true) {
      while (!finished_.empty()) {
        const uint32_t shard = finished_.front();
        finished_.pop_front();
        Settle(shard);
      }
      std::optional<std::chrono::steady_clock::time_point> next_retry;
      for (uint32_t shard = 0; shard < state_.size(); ++shard) {
        const auto& retry_at = state_[shard].retry_at;
        if (!retry_at) continue;
        if (*retry_at <= std::chrono::steady_clock::now()) {
          Start(shard);
        } else if (!next_retry || *retry_at < *next_retry) {
          next_retry = retry_at;
        }
      }
      if (active_ == 0 && !next_retry) break;
      const auto has_news = [this]()
                                ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !finished_.empty(); };
      if (next_retry) {
        mu_.AwaitWithTimeout(absl::Condition(&has_news),
                             absl::FromChrono(*next_retry - std::chrono::steady_clock::now()));
      } else {
        mu_.Await(absl::Condition(&has_news));
      }
    }
  }
  if (cancel_id != 0) options_.cancellation->Unregister(cancel_id);

  absl::MutexLock lock(&mu_);
  if (cancelled_ && failure_.ok()) failure_ = absl::CancelledError("the gather was cancelled");
  if (!failure_.ok()) {
    return absl::Status(failure_.code(),
                        absl::StrCat("gathering layer ", layer_, ": ", failure_.message()));
  }
  if (options_.incarnations != nullptr) {
    options_.incarnations->clear();
    for (const ShardState& s : state_) options_.incarnations->push_back(s.incarnation);
  }
  return version_.value_or(default_version_);
}

}  // namespace layercast::client
