#include "server/serving/fetch_layer_reactor.h"

#include <grpc/grpc.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "platform/byte_size.h"
#include "platform/failpoint.h"
#include "server/serving/answer_before.h"
#include "server/serving/refusals.h"
#include "wire/chunk_encoder.h"
#include "wire/grpc_status.h"

namespace layercast::server {
FetchLayerReactor::FetchLayerReactor(grpc::CallbackServerContext* context,
                                     std::unique_ptr<ChunkSource> source, VersionGate& gate,
                                     MemoryBudget& budget, ServerMetrics& metrics, FetchPlan plan,
                                     Options options)
    : StreamReactor(context, *options.clock),
      source_(std::move(source)),
      gate_(gate),
      budget_(budget),
      metrics_(metrics),
      plan_(std::move(plan)),
      options_(std::move(options)),
      buffer_bytes_(
          StreamBufferBytes(plan_, options_.chunk_bytes, options_.base_version.has_value())) {
  if (!plan_.runs.empty()) next_element_ = plan_.runs[0].elements.begin;
  metrics_.streams_waiting_for_version().Increment();
  absl::MutexLock lock(&mu_);
  // Posted, never run here: this constructor has not returned to gRPC yet.
  wait_id_ = gate_.Wait(plan_.layer, options_.min_version + options_.gate_offset,
                        options_.version_give_up_at,
                        [this](VersionGate::Outcome outcome, uint64_t counted) {
                          OnVersion(outcome, counted - std::min(counted, options_.gate_offset));
                        });
}

grpc::Status FetchLayerReactor::CancelledWhileWaiting(absl::string_view what) const {
  const bool expired = context_->deadline() <= std::chrono::system_clock::now();
  return wire::ToGrpcStatus(absl::Status(
      expired ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kCancelled,
      absl::StrCat(what, " when the call ", expired ? "reached its deadline" : "was cancelled")));
}

void FetchLayerReactor::OnVersion(VersionGate::Outcome outcome, uint64_t version) {
  metrics_.streams_waiting_for_version().Decrement();
  // Before anything is granted: a grant may finish the stream at once.
  if (outcome == VersionGate::Outcome::kReached && options_.on_unparked) options_.on_unparked();
  // Before the stream's own lock: a shard's source takes the layer's.
  std::optional<absl::StatusOr<uint64_t>> started;
  if (outcome == VersionGate::Outcome::kReached) started = source_->Start(version);
  std::optional<grpc::Status> finish;
  bool streaming = false;
  {
    absl::MutexLock lock(&mu_);
    wait_id_ = 0;
    if (cancelled_) {
      finish = CancelledWhileWaiting(absl::StrCat(
          "waiting for parameter version ", options_.min_version, " (current ", version, ")"));
    } else if (outcome == VersionGate::Outcome::kClosed) {
      finish = ShuttingDownRefusal(
          absl::StrCat("the stream waited for parameter version ", options_.min_version,
                       " (current ", version, "); retry against its replacement"),
          options_.server);
    } else if (outcome == VersionGate::Outcome::kTimedOut) {
      const std::string waiting_for = source_->WaitingFor();
      finish = wire::ToGrpcStatus(absl::DeadlineExceededError(
          absl::StrCat("parameter version ", options_.min_version, " was not reached (current ",
                       version, ") within the call's deadline or this ", options_.server,
                       "'s limit on waiting for a version (--max-version-wait-ms)",
                       waiting_for.empty() ? "; ask again" : absl::StrCat(": ", waiting_for))));
    } else if (!started->ok()) {
      finish = wire::ToGrpcStatus(started->status());
    } else {
      version_ = **started;
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
      finish = wire::ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
          "no memory budget became free for this stream's ", FormatBytes(buffer_bytes_),
          " of chunk buffers before its deadline: the ", options_.server, "'s budget of ",
          budget ? FormatBytes(*budget) : "unlimited", " has ", FormatBytes(budget_.in_use()),
          " in use (fp32 master included) and ", budget_.waiting(),
          " stream(s) waiting; retry later, or raise --memory-budget or lower --chunk-bytes")));
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

void FetchLayerReactor::WriteNext() {
  if (run_ == plan_.runs.size()) {
    FinishOnce(grpc::Status::OK);
    return;
  }
  if (stop_) {
    FinishOnce(ShuttingDownRefusal(
        "its drain timeout has passed; resume the rest of the layer against its replacement",
        options_.server));
    return;
  }
  const TensorElementRange& run = plan_.runs[run_];
  const AssembledTensor& placed = plan_.layout.tensors()[run.tensor];
  const DType dtype = placed.compute_dtype;
  const ChunkGrid grid(options_.chunk_bytes, placed, source_->Owned(run.tensor));
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
  const uint64_t bytes =
      SentBytes(placed, ElementRange{key.element_begin, key.element_begin + key.elements}) +
      (options_.base_version
           ? DeltaExtraBytes(key.elements,
                             placed.block_size == 0 ? 0 : key.elements / placed.block_size + 2)
           : 0);
  // A chunk another stream is making resumes this one when it is done
  // (posted: nothing runs on that stream's thread); until then nothing of
  // this stream runs, and it cannot finish, so `this` stays valid.
  std::optional<absl::StatusOr<CastChunk>> chunk =
      source_->Get(key, bytes, [this](absl::StatusOr<CastChunk> made) { Write(std::move(made)); });
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
  FailPoint("fetch.mid_stream", source_->shard_index());
  StampStart();
  StartWrite(&chunk_);
}

void FetchLayerReactor::OnWriteDone(bool ok) {
  StampDone();
  if (!ok) {
    FinishOnce(wire::ToGrpcStatus(
        absl::CancelledError(stalled() ? "the client stopped reading: no chunk was drained within "
                                         "the shard's --write-progress-timeout-ms"
                                       : "the client went away mid-stream")));
    return;
  }
  metrics_.RecordChunkSent(pending_dtype_, pending_elements_, pending_bytes_);
  source_->Sent();
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
      const uint64_t counted = gate_.version(plan_.layer);
      finish = CancelledWhileWaiting(
          absl::StrCat("waiting for parameter version ", options_.min_version, " (current ",
                       counted - std::min(counted, options_.gate_offset), ")"));
    } else if (phase_ == Phase::kWaitingForBudget && wait_id_ != 0 && budget_.Cancel(wait_id_)) {
      finish = CancelledWhileWaiting("waiting for memory budget");
    }
  }
  if (finish) FinishOnce(*finish);
}

void FetchLayerReactor::OnDone() {
  if (holds_budget_) budget_.Release(buffer_bytes_);
  source_.reset();  // before on_done: a source holds what the service may take away
  if (options_.on_done) options_.on_done(this, final_status());
  delete this;
}

}  // namespace layercast::server
