#include "server/fetch_layer_reactor.h"

#include <grpc/grpc.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/changed_bits.h"
#include "platform/byte_size.h"
#include "platform/failpoint.h"
#include "platform/status_macros.h"
#include "server/answer_before.h"
#include "server/refusals.h"
#include "wire/chunk_encoder.h"
#include "wire/delta_chunks.h"
#include "wire/grpc_status.h"

namespace layercast::server {
FetchLayerReactor::FetchLayerReactor(grpc::CallbackServerContext* context,
                                     const ParameterStore& store, VersionGate& gate,
                                     MemoryBudget& budget, ServerMetrics& metrics, FetchPlan plan,
                                     Options options)
    : StreamReactor(context, *options.clock),
      store_(store),
      gate_(gate),
      budget_(budget),
      metrics_(metrics),
      plan_(std::move(plan)),
      options_(std::move(options)),
      caster_(store, metrics,
              {.chunk_bytes = options_.chunk_bytes,
               .cast_errors = options_.cast_errors,
               .recast = options_.recast,
               .own_dtype = plan_.dtype.has_value(),
               .sample_every = options_.cast_error_sample_every}),
      buffer_bytes_(
          StreamBufferBytes(plan_, options_.chunk_bytes, options_.base_version.has_value())),
      peer_(context->peer()) {
  if (!plan_.runs.empty()) next_element_ = plan_.runs[0].elements.begin;
  // What keeps a training shard recording its steps (ChangeLog::Wanted).
  if (options_.changes != nullptr &&
      (options_.base_version || options_.exact_version || options_.will_pull_deltas)) {
    options_.changes->NoteAsked();
  }
  if (options_.shared != nullptr) options_.shared->BeginStream(plan_.layer, peer_);
  metrics_.streams_waiting_for_version().Increment();
  absl::MutexLock lock(&mu_);
  // Posted, never run here: this constructor has not returned to gRPC yet.
  wait_id_ = gate_.Wait(
      plan_.layer, options_.min_version, options_.version_give_up_at,
      [this](VersionGate::Outcome outcome, uint64_t version) { OnVersion(outcome, version); });
}

grpc::Status FetchLayerReactor::CancelledWhileWaiting(absl::string_view what) const {
  const bool expired = context_->deadline() <= std::chrono::system_clock::now();
  return grpc::Status(
      expired ? grpc::StatusCode::DEADLINE_EXCEEDED : grpc::StatusCode::CANCELLED,
      absl::StrCat(what, " when the call ", expired ? "reached its deadline" : "was cancelled"));
}

void FetchLayerReactor::OnVersion(VersionGate::Outcome outcome, uint64_t version) {
  metrics_.streams_waiting_for_version().Decrement();
  // Before anything is granted: a grant may finish the stream at once.
  if (outcome == VersionGate::Outcome::kReached && options_.on_unparked) options_.on_unparked();
  // Before the stream's own lock: this takes the layer's.
  const std::optional<grpc::Status> gone =
      outcome == VersionGate::Outcome::kReached ? HoldExactVersion(version) : std::nullopt;
  std::optional<grpc::Status> finish;
  bool streaming = false;
  {
    absl::MutexLock lock(&mu_);
    wait_id_ = 0;
    if (cancelled_) {
      finish = CancelledWhileWaiting(absl::StrCat(
          "waiting for parameter version ", options_.min_version, " (current ", version, ")"));
    } else if (outcome == VersionGate::Outcome::kClosed) {
      finish = ShuttingDownRefusal(absl::StrCat("the stream waited for parameter version ",
                                                options_.min_version, " (current ", version,
                                                "); retry against its replacement"));
    } else if (outcome == VersionGate::Outcome::kTimedOut) {
      finish = grpc::Status(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          absl::StrCat("parameter version ", options_.min_version, " was not reached (current ",
                       version, ") within the call's deadline or this shard's limit on waiting ",
                       "for a version (--max-version-wait-ms)",
                       options_.waiting_for ? absl::StrCat(": ", options_.waiting_for(plan_.layer))
                                            : std::string("; ask again")));
    } else if (gone) {
      finish = *gone;
    } else if (const uint64_t target = options_.exact_version.value_or(version);
               options_.base_version &&
               !options_.changes->Covers(plan_.layer, *options_.base_version, target)) {
      finish =
          grpc::Status(grpc::StatusCode::OUT_OF_RANGE,
                       absl::StrCat("this shard no longer holds the changes of layer ", plan_.layer,
                                    " since base_version ", *options_.base_version, " to version ",
                                    target, ": it keeps the last ", options_.changes->versions(),
                                    " versions' changes (--delta-versions; a delta to ", target,
                                    " can start from version ",
                                    options_.changes->OldestBase(plan_.layer, target),
                                    "); pull the layer in full"));
    } else {
      version_ = options_.exact_version.value_or(version);
      phase_ = Phase::kWaitingForBudget;
      if (buffer_bytes_ == 0) {  // this shard owns nothing of the range
        phase_ = Phase::kStreaming;
        streaming = true;
      } else {
        wait_id_ = budget_.Acquire(buffer_bytes_,
                                   AnswerBefore(context_->deadline(), options_.clock->Now()),
                                   [this](bool granted) { OnBudget(granted); });
      }
    }
  }
  if (finish) FinishOnce(*finish);
  if (streaming) WriteNext();
}

void FetchLayerReactor::OnBudget(bool granted) {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    wait_id_ = 0;
    holds_budget_ = granted;
    if (cancelled_) {
      finish = CancelledWhileWaiting("waiting for memory budget");
    } else if (!granted) {
      const std::optional<uint64_t> budget = budget_.budget();
      finish = grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("no memory budget became free for this stream's ",
                       FormatBytes(buffer_bytes_), " of chunk buffers before its deadline: the ",
                       "shard's budget of ", budget ? FormatBytes(*budget) : "unlimited", " has ",
                       FormatBytes(budget_.in_use()), " in use (fp32 master included) and ",
                       budget_.waiting(), " stream(s) waiting; retry later, or raise ",
                       "--memory-budget or lower --chunk-bytes"));
    } else {
      phase_ = Phase::kStreaming;
    }
  }
  if (finish) {
    FinishOnce(*finish);
    return;
  }
  WriteNext();
}

std::string FetchLayerReactor::WhyNotKept() const {
  if (options_.pinned != nullptr) {
    return absl::StrCat("it keeps a layer's ", options_.pinned->per_layer(),
                        " newest superseded versions (--pin-versions) and those a pinned reader "
                        "read within --pin-retention-ms, while its memory budget has room: raise "
                        "--pin-versions or --pin-retention-ms, or give it more memory");
  }
  return options_.changes == nullptr ? "it keeps none: --delta-versions 0"
                                     : "it keeps none: --pin-retention-ms 0";
}

absl::Status FetchLayerReactor::NotInThisDType(uint64_t version, uint64_t current) const {
  return absl::AbortedError(
      absl::StrCat("layer ", plan_.layer, " is at parameter version ", current,
                   ", and what this shard keeps of version ", version,
                   " (the policy's dtypes) cannot give ", DTypeName(*plan_.dtype), "; ",
                   options_.exact_version ? "walk the model again at version "
                                          : "gather the layer again with min_version ",
                   current));
}

void FetchLayerReactor::LeaseExactVersion() {
  // A walk at this version holds it on the layers it has not read yet; a
  // stream whose dtype the kept bits cannot give would hold it for nothing.
  if (options_.pinned != nullptr && plan_.kept_bits_serve) {
    options_.pinned->Lease(*options_.exact_version);
  }
}

std::optional<grpc::Status> FetchLayerReactor::HoldExactVersion(uint64_t current) {
  if (!options_.exact_version) return std::nullopt;
  const uint64_t exact = *options_.exact_version;
  if (exact == current || buffer_bytes_ == 0) {
    LeaseExactVersion();
    return std::nullopt;
  }
  if (!plan_.kept_bits_serve) return wire::ToGrpcStatus(NotInThisDType(exact, current));
  absl::ReaderMutexLock master_lock(&store_.layer_mutex(plan_.layer));
  if (options_.changes != nullptr) {
    if (options_.changes->ChangedNothing(plan_.layer, exact, current)) {
      LeaseExactVersion();
      return std::nullopt;
    }
    if (options_.pinned != nullptr) {
      held_ = options_.pinned->Find(plan_.layer, exact, *options_.changes);
    }
  }
  if (held_ != nullptr) {
    LeaseExactVersion();
    return std::nullopt;
  }
  if (options_.pinned != nullptr) metrics_.RecordPinnedRead("gone");
  return grpc::Status(grpc::StatusCode::ABORTED,
                      absl::StrCat("layer ", plan_.layer, " is at parameter version ", current,
                                   " and this shard no longer keeps version ", exact, " (",
                                   WhyNotKept(), "); walk the model again at version ", current));
}

absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> FetchLayerReactor::SourceOf(
    const ChunkKey& key) {
  const uint64_t now = gate_.version(key.layer);
  if (now == key.version) return nullptr;
  if (!plan_.kept_bits_serve) return NotInThisDType(key.version, now);
  std::shared_ptr<const PinnedVersions::Kept> kept;
  if (options_.changes != nullptr &&
      !options_.changes->ChangedNothing(key.layer, key.version, now)) {
    kept = held_;
    if (kept == nullptr && options_.pinned != nullptr) {
      kept = options_.pinned->Find(key.layer, key.version, *options_.changes);
    }
    if (kept == nullptr) {
      // Overtaken: the steps after this one keep what such a stream needs.
      options_.changes->NoteAsked();
      if (options_.pinned != nullptr) metrics_.RecordPinnedRead("gone");
      return absl::AbortedError(absl::StrCat(
          "layer ", key.layer, " moved from parameter version ", key.version, " to ", now,
          " while this stream sent it, and this shard no longer keeps version ", key.version, " (",
          WhyNotKept(), "); ",
          options_.exact_version ? absl::StrCat("walk the model again at version ", now)
                                 : absl::StrCat("gather the layer again with min_version ", now)));
    }
  } else if (options_.changes == nullptr) {
    return absl::AbortedError(absl::StrCat("layer ", key.layer, " moved from parameter version ",
                                           key.version, " to ", now, " while this stream sent it (",
                                           WhyNotKept(),
                                           "); gather the layer again with min_version ", now));
  }
  if (!pinned_.exchange(true)) {
    metrics_.pinned_readers().Increment();
    metrics_.RecordPinnedRead("served");
  }
  return kept;
}

absl::StatusOr<CastChunk> FetchLayerReactor::Cast(const ChunkKey& key) {
  if (key.base_version != ChunkKey::kWhole) return CastDelta(key);
  // Shared with other readers, exclusive of an optimizer step: the chunk is
  // cast from one version, and it is the stream's.
  absl::ReaderMutexLock master_lock(&store_.layer_mutex(key.layer));
  ASSIGN_OR_RETURN(const std::shared_ptr<const PinnedVersions::Kept> kept, SourceOf(key));
  const AssembledTensor& placed = plan_.layout.tensors()[key.tensor];
  const size_t bytes =
      SentBytes(placed, ElementRange{key.element_begin, key.element_begin + key.elements});
  auto* data = static_cast<uint8_t*>(std::malloc(bytes));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory for a chunk of ", FormatBytes(bytes), "; retry later"));
  }
  // Owned by gRPC from here: freed when the last stream sending it is done.
  CastChunk chunk{grpc::Slice(data, bytes, std::free), 0};
  chunk.scale_bytes = bytes - key.elements * DTypeSize(key.dtype);
  RETURN_IF_ERROR(caster_.CastInto(key, placed, kept.get(), data, &chunk.crc32c));
  return chunk;
}

absl::StatusOr<CastChunk> FetchLayerReactor::CastDelta(const ChunkKey& key) {
  absl::ReaderMutexLock master_lock(&store_.layer_mutex(key.layer));
  // When neither the master nor a kept version holds key.version: gathered
  // again from the same base, a delta applied twice, or over a copy already
  // partly newer, still gives the newest version exactly.
  ASSIGN_OR_RETURN(const std::shared_ptr<const PinnedVersions::Kept> kept, SourceOf(key));
  // Checked again under the layer's lock: changes recorded since the stream
  // began may have pushed (base, version] out of the log, and a delta
  // without them would leave changed values unsent.
  if (!options_.changes->Covers(key.layer, key.base_version, key.version)) {
    return absl::OutOfRangeError(absl::StrCat(
        "layer ", key.layer, " moved on while this stream sent a delta from version ",
        key.base_version, " to ", key.version,
        ", and this shard no longer holds the changes between them; pull the layer in full"));
  }
  // The span is cast whole (the kernels run on contiguous elements) into
  // scratch that stays with the thread, then only its changed elements are
  // packed into the chunk.
  thread_local std::vector<uint8_t> values;
  thread_local std::vector<uint64_t> changed;
  const AssembledTensor& placed = plan_.layout.tensors()[key.tensor];
  const wire::DeltaSpan span{.tensor = key.tensor,
                             .element_offset = key.element_begin,
                             .span_elements = key.elements,
                             .version = key.version,
                             .base_version = key.base_version,
                             .gaps_allowed = key.gaps};
  try {
    values.resize(SentBytes(placed, {key.element_begin, key.element_begin + key.elements}));
    RETURN_IF_ERROR(caster_.CastInto(key, placed, kept.get(), values.data(), nullptr));
    options_.changes->ChangedSince(key.layer, key.base_version, key.version, key.tensor,
                                   key.element_begin, key.elements, changed);
    if (placed.block_size != 0) return CastFp8Delta(key, placed, span, values, changed);
    return CastChunk{wire::EncodeDeltaChunk(span, values, DTypeSize(key.dtype), changed), 0,
                     /*framed=*/true};
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("out of memory for a delta chunk of ",
                                                     key.elements, " elements; retry later"));
  }
}

absl::StatusOr<CastChunk> FetchLayerReactor::CastFp8Delta(const ChunkKey& key,
                                                          const AssembledTensor& placed,
                                                          const wire::DeltaSpan& span,
                                                          std::span<const uint8_t> quantized,
                                                          std::vector<uint64_t>& changed) {
  const uint64_t first = key.element_begin / placed.block_size;
  const uint64_t blocks =
      (key.element_begin + key.elements + placed.block_size - 1) / placed.block_size - first;
  const std::span<const uint8_t> scales = quantized.subspan(key.elements, blocks * sizeof(float));
  thread_local std::vector<uint64_t> scales_changed;
  // `changed` holds the span's fp32 values that changed (what the log
  // records of an 8-bit float tensor): with none in a span of whole blocks,
  // no code or scale of it moved. (A span that starts or ends inside a
  // block, a ranged pull's, shares the block's scale with elements outside
  // it.) Else the base is quantized again, and the codes and scales
  // compared.
  const bool whole_blocks = key.element_begin % placed.block_size == 0 &&
                            ((key.element_begin + key.elements) % placed.block_size == 0 ||
                             key.element_begin + key.elements == placed.num_elements);
  if (whole_blocks &&
      std::all_of(changed.begin(), changed.end(), [](uint64_t word) { return word == 0; })) {
    scales_changed.assign((blocks + 63) / 64, 0);
  } else {
    ASSIGN_OR_RETURN(const std::shared_ptr<const PinnedVersions::Kept> base, BaseOf(key));
    thread_local std::vector<uint8_t> was;
    was.resize(quantized.size());
    ChunkKey at_base = key;
    at_base.version = key.base_version;
    caster_.Quantize(at_base, placed, base.get(), was.data());
    MarkChangedBits(quantized.data(), was.data(), key.elements, 1, changed);
    MarkChangedBits(scales.data(), was.data() + key.elements, blocks, sizeof(float),
                    scales_changed);
  }
  const wire::DeltaScales delta_scales{scales, scales_changed};
  return CastChunk{
      wire::EncodeDeltaChunk(span, quantized.first(key.elements), 1, changed, &delta_scales), 0,
      /*framed=*/true};
}

absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> FetchLayerReactor::BaseOf(
    const ChunkKey& key) {
  if (options_.changes->ChangedNothing(key.layer, key.base_version, gate_.version(key.layer))) {
    return nullptr;  // the master holds the base's values
  }
  std::shared_ptr<const PinnedVersions::Kept> kept;
  if (options_.pinned != nullptr) {
    kept = options_.pinned->Find(key.layer, key.base_version, *options_.changes);
  }
  if (kept == nullptr) {
    options_.changes->NoteAsked();
    return absl::OutOfRangeError(absl::StrCat(
        "layer ", key.layer, " has tensor ",
        store_.model().layers[key.layer].tensors[key.tensor].name, " in ", DTypeName(key.dtype),
        ", whose delta quantizes the base again from the fp32 this shard kept of it, and it no "
        "longer keeps version ",
        key.base_version, " (", WhyNotKept(), "); pull the layer in full"));
  }
  return kept;
}

void FetchLayerReactor::WriteNext() {
  if (run_ == plan_.runs.size()) {
    FinishOnce(grpc::Status::OK);
    return;
  }
  if (stop_) {
    FinishOnce(ShuttingDownRefusal(
        "its drain timeout has passed; resume the rest of the layer against its replacement"));
    return;
  }
  const TensorElementRange& run = plan_.runs[run_];
  const AssembledTensor& placed = plan_.layout.tensors()[run.tensor];
  const DType dtype = placed.compute_dtype;
  const ChunkGrid grid(options_.chunk_bytes, placed, store_.owned(plan_.layer, run.tensor));
  const ChunkKey key{
      .layer = plan_.layer,
      .tensor = run.tensor,
      .element_begin = next_element_,
      .elements = std::min(run.elements.end, grid.ChunkEnd(next_element_)) - next_element_,
      .version = version_,
      .dtype = dtype,
      .base_version = options_.base_version.value_or(ChunkKey::kWhole),
      .gaps = options_.base_version.has_value() && options_.changed_gaps};
  pending_dtype_ = dtype;
  pending_elements_ = key.elements;
  const auto cast = [this, &key] { return Cast(key); };
  if (options_.shared == nullptr) {
    Write(cast());
    return;
  }
  // Another stream casting this very chunk resumes this one when it is done
  // (posted: nothing runs on that stream's thread); until then nothing of
  // this stream runs, and it cannot finish, so `this` stays valid.
  std::optional<absl::StatusOr<CastChunk>> chunk = options_.shared->GetOrCast(
      key,
      SentBytes(placed, ElementRange{key.element_begin, key.element_begin + key.elements}) +
          (options_.base_version
               ? DeltaExtraBytes(key.elements,
                                 placed.block_size == 0 ? 0 : key.elements / placed.block_size + 2)
               : 0),
      peer_, cast, [this](absl::StatusOr<CastChunk> shared) { Write(shared); });
  if (chunk) Write(*std::move(chunk));
}

void FetchLayerReactor::Write(absl::StatusOr<CastChunk> chunk) {
  if (!chunk.ok()) {
    FinishOnce(chunk.status());
    return;
  }
  const TensorElementRange& run = plan_.runs[run_];
  // Counted as the tensor bytes the chunk stands for: a delta's dense
  // size (its own size goes to the delta metrics), an fp8 chunk's codes
  // and scales.
  pending_bytes_ = pending_elements_ * DTypeSize(pending_dtype_);
  if (chunk->framed) {
    metrics_.RecordDeltaChunk(chunk->data.size(), pending_bytes_);
  } else {
    pending_bytes_ = chunk->data.size();
  }
  chunk_ = chunk->framed ? grpc::ByteBuffer(&chunk->data, 1)
                         : wire::EncodeLayerChunk(run.tensor, next_element_, version_,
                                                  chunk->crc32c, chunk->data, chunk->scale_bytes);
  next_element_ += pending_elements_;
  if (next_element_ == run.elements.end && ++run_ < plan_.runs.size()) {
    next_element_ = plan_.runs[run_].elements.begin;
  }
  // A death mid-stream: the reader resumes against the shard's next start.
  FailPoint("fetch.mid_stream", store_.shard_index());
  StampStart();
  StartWrite(&chunk_);
}

void FetchLayerReactor::OnWriteDone(bool ok) {
  StampDone();
  if (!ok) {
    FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED,
                            stalled() ? "the client stopped reading: no chunk was drained within "
                                        "the shard's --write-progress-timeout-ms"
                                      : "the client went away mid-stream"));
    return;
  }
  metrics_.RecordChunkSent(pending_dtype_, pending_elements_, pending_bytes_);
  WriteNext();
}

void FetchLayerReactor::OnCancel() {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    // A wait still registered is withdrawn here and this side finishes; a
    // wait whose grant is already posted (Cancel is false) or a phase in
    // between is finished by that grant, which sees `cancelled_`; a stream
    // in flight is finished by its failing write.
    if (phase_ == Phase::kWaitingForVersion && wait_id_ != 0 && gate_.Cancel(wait_id_)) {
      metrics_.streams_waiting_for_version().Decrement();
      finish =
          CancelledWhileWaiting(absl::StrCat("waiting for parameter version ", options_.min_version,
                                             " (current ", gate_.version(plan_.layer), ")"));
    } else if (phase_ == Phase::kWaitingForBudget && wait_id_ != 0 && budget_.Cancel(wait_id_)) {
      finish = CancelledWhileWaiting("waiting for memory budget");
    }
  }
  if (finish) FinishOnce(*finish);
}

void FetchLayerReactor::OnDone() {
  if (holds_budget_) budget_.Release(buffer_bytes_);
  if (pinned_) metrics_.pinned_readers().Decrement();
  if (options_.shared != nullptr) options_.shared->EndStream(plan_.layer, peer_);
  if (options_.on_done) options_.on_done(this, final_status());
  delete this;
}

}  // namespace layercast::server
