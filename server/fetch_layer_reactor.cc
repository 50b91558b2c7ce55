#include "server/fetch_layer_reactor.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "core/byte_size.h"
#include "core/cast.h"
#include "core/crc32c.h"
#include "server/chunk_encoder.h"
#include "server/grpc_status.h"

namespace layercast::server {
namespace {

// Casts run in blocks whose output stays in the core's cache, so the CRC
// reads it back from there instead of from memory: 48 KiB of bfloat16, four
// of Crc32c's three-stripe blocks.
constexpr uint64_t kCastBlockElements = 24 << 10;

uint64_t ElementsPerChunk(uint64_t chunk_bytes, size_t element_bytes) {
  return std::max<uint64_t>(1, chunk_bytes / element_bytes);
}

// When a stream waiting for budget gives up: a little before the client's
// deadline, so RESOURCE_EXHAUSTED reaches the client instead of its own
// DEADLINE_EXCEEDED.
std::chrono::steady_clock::time_point GiveUpAt(std::chrono::system_clock::time_point deadline) {
  const auto now = std::chrono::system_clock::now();
  if (deadline >= std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365)) {
    return std::chrono::steady_clock::time_point::max();
  }
  const auto remaining = std::max(deadline - now, std::chrono::system_clock::duration::zero());
  const auto margin =
      std::min<std::chrono::system_clock::duration>(std::chrono::milliseconds(500), remaining / 10);
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(remaining - margin);
}

}  // namespace

uint64_t FetchLayerReactor::BufferBytes(const ParameterStore& store, const FetchPlan& plan,
                                        uint64_t chunk_bytes) {
  uint64_t largest = 0;
  for (const TensorElementRange& run : plan.runs) {
    const size_t size = DTypeSize(store.layout(plan.layer).tensors()[run.tensor].compute_dtype);
    largest = std::max(largest,
                       std::min(run.elements.size(), ElementsPerChunk(chunk_bytes, size)) * size);
  }
  return 2 * largest;
}

FetchLayerReactor::FetchLayerReactor(grpc::CallbackServerContext* context,
                                     const ParameterStore& store, VersionGate& gate,
                                     MemoryBudget& budget, ServerMetrics& metrics, FetchPlan plan,
                                     Options options)
    : context_(context),
      store_(store),
      gate_(gate),
      budget_(budget),
      metrics_(metrics),
      plan_(std::move(plan)),
      options_(std::move(options)),
      buffer_bytes_(BufferBytes(store_, plan_, options_.chunk_bytes)),
      peer_(context->peer()) {
  if (!plan_.runs.empty()) next_element_ = plan_.runs[0].elements.begin;
  if (options_.shared != nullptr) options_.shared->BeginStream(plan_.layer, peer_);
  metrics_.streams_waiting_for_version().Increment();
  version_wait_id_ = gate_.Wait(options_.min_version, [this] { OnVersionReached(); });
}

void FetchLayerReactor::OnVersionReached() {
  metrics_.streams_waiting_for_version().Decrement();
  version_ = gate_.version();
  phase_ = Phase::kWaitingForBudget;
  if (buffer_bytes_ == 0) {  // this shard owns nothing of the range
    OnBudget(true);
    return;
  }
  budget_wait_id_ = budget_.Acquire(buffer_bytes_, GiveUpAt(context_->deadline()),
                                    [this](bool granted) { OnBudget(granted); });
}

void FetchLayerReactor::OnBudget(bool granted) {
  if (!granted) {
    const std::optional<uint64_t> budget = budget_.budget();
    FinishOnce(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("no memory budget became free for this stream's ", FormatBytes(buffer_bytes_),
                     " of chunk buffers before its deadline: the ", "shard's budget of ",
                     budget ? FormatBytes(*budget) : "unlimited", " has ",
                     FormatBytes(budget_.in_use()), " in use (fp32 master included) and ",
                     budget_.waiting(), " stream(s) waiting; retry later, or raise ",
                     "--memory-budget or lower --chunk-bytes")));
    return;
  }
  holds_budget_ = buffer_bytes_ > 0;
  phase_ = Phase::kStreaming;
  WriteNext();
}

absl::StatusOr<CastChunk> FetchLayerReactor::Cast(const ChunkKey& key) {
  const ElementRange owned = store_.owned(key.layer, key.tensor);
  const float* source = store_.master(key.layer, key.tensor) + (key.element_begin - owned.begin);
  const size_t element_bytes = DTypeSize(key.dtype);
  const size_t bytes = key.elements * element_bytes;
  auto* data = static_cast<uint8_t*>(std::malloc(bytes));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory for a chunk of ", FormatBytes(bytes), "; retry later"));
  }
  // Owned by gRPC from here: freed when the last stream sending it is done.
  CastChunk chunk{grpc::Slice(data, bytes, std::free), 0};
  const auto cast_start = std::chrono::steady_clock::now();
  for (uint64_t done = 0; done < key.elements;) {
    const uint64_t block = std::min(kCastBlockElements, key.elements - done);
    uint8_t* out = data + done * element_bytes;
    if (absl::Status cast =
            CastFromF32(source + done, out, block, key.dtype, store_.policy().overflow());
        !cast.ok()) {
      const std::string& name = store_.model().layers[key.layer].tensors[key.tensor].name;
      return absl::Status(cast.code(),
                          absl::StrCat("tensor ", name, " (from element ", key.element_begin + done,
                                       "): ", cast.message(),
                                       "; the policy's float16 overflow rule is 'error': set "
                                       "overflow=saturate or override this tensor to float32"));
    }
    chunk.crc32c = Crc32c(out, block * element_bytes, chunk.crc32c);
    done += block;
  }
  metrics_.RecordCast(
      key.elements,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - cast_start).count());
  metrics_.RecordChunkCast();
  return chunk;
}

void FetchLayerReactor::WriteNext() {
  if (run_ == plan_.runs.size()) {
    FinishOnce(grpc::Status::OK);
    return;
  }
  const TensorElementRange& run = plan_.runs[run_];
  const DType dtype = store_.layout(plan_.layer).tensors()[run.tensor].compute_dtype;
  const size_t element_bytes = DTypeSize(dtype);
  // Chunks lie on a grid from the start of this shard's slice, wherever a
  // request's range starts, so a resumed or ranged stream still meets the
  // chunks other streams have cast.
  const uint64_t owned_begin = store_.owned(plan_.layer, run.tensor).begin;
  const uint64_t per_chunk = ElementsPerChunk(options_.chunk_bytes, element_bytes);
  const uint64_t grid_end =
      owned_begin + ((next_element_ - owned_begin) / per_chunk + 1) * per_chunk;
  const ChunkKey key{.layer = plan_.layer,
                     .tensor = run.tensor,
                     .element_begin = next_element_,
                     .elements = std::min(run.elements.end, grid_end) - next_element_,
                     .version = version_,
                     .dtype = dtype};
  const auto cast = [this, &key] { return Cast(key); };
  absl::StatusOr<CastChunk> chunk =
      options_.shared != nullptr
          ? options_.shared->GetOrCast(key, key.elements * element_bytes, peer_, cast)
          : cast();
  if (!chunk.ok()) {
    FinishOnce(ToGrpcStatus(chunk.status()));
    return;
  }
  chunk_ = EncodeLayerChunk(run.tensor, next_element_, version_, chunk->crc32c, chunk->data);
  pending_dtype_ = dtype;
  pending_elements_ = key.elements;
  next_element_ += key.elements;
  if (next_element_ == run.elements.end && ++run_ < plan_.runs.size()) {
    next_element_ = plan_.runs[run_].elements.begin;
  }
  StartWrite(&chunk_);
}

void FetchLayerReactor::OnWriteDone(bool ok) {
  if (!ok) {
    FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away mid-stream"));
    return;
  }
  metrics_.RecordChunkSent(pending_dtype_, pending_elements_);
  WriteNext();
}

void FetchLayerReactor::OnCancel() {
  const bool expired = context_->deadline() <= std::chrono::system_clock::now();
  const grpc::StatusCode code =
      expired ? grpc::StatusCode::DEADLINE_EXCEEDED : grpc::StatusCode::CANCELLED;
  const char* why = expired ? "deadline expired" : "was cancelled";
  switch (phase_.load()) {
    case Phase::kWaitingForVersion: {
      const uint64_t id = version_wait_id_.load();
      if (id == 0 || !gate_.Cancel(id)) return;  // the version arrived: the next step finishes
      metrics_.streams_waiting_for_version().Decrement();
      FinishOnce(grpc::Status(code, absl::StrCat("parameter version ", options_.min_version,
                                                 " was not reached (current ", gate_.version(),
                                                 ") before the call ", why)));
      return;
    }
    case Phase::kWaitingForBudget: {
      const uint64_t id = budget_wait_id_.load();
      if (id == 0 || !budget_.Cancel(id)) return;  // granted: the write will fail and finish
      FinishOnce(grpc::Status(code, absl::StrCat("waiting for memory budget when the call ", why)));
      return;
    }
    case Phase::kStreaming:
      return;  // the write in flight fails and OnWriteDone finishes
  }
}

void FetchLayerReactor::FinishOnce(const grpc::Status& status) {
  if (finished_.exchange(true)) return;
  final_status_ = status;
  Finish(status);
}

void FetchLayerReactor::OnDone() {
  if (holds_budget_) budget_.Release(buffer_bytes_);
  if (options_.shared != nullptr) options_.shared->EndStream(plan_.layer, peer_);
  if (options_.on_done) options_.on_done(final_status_);
  delete this;
}

}  // namespace layercast::server
