#include "server/fetch_layer_reactor.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "server/grpc_status.h"

namespace layercast::server {

FetchLayerReactor::FetchLayerReactor(grpc::CallbackServerContext* context,
                                     const ParameterStore& store, VersionGate& gate,
                                     FetchPlan plan, Options options)
    : context_(context),
      store_(store),
      gate_(gate),
      plan_(std::move(plan)),
      options_(std::move(options)) {
  if (!plan_.runs.empty()) next_element_ = plan_.runs[0].elements.begin;
  waiting_for_version_ = true;
  options_.metrics->streams_waiting_for_version().Increment();
  wait_id_ = gate_.Wait(options_.min_version, [this] {
    StopWaiting();
    chunk_.set_version(gate_.version());
    WriteNext();
  });
}

void FetchLayerReactor::StopWaiting() {
  if (waiting_for_version_.exchange(false)) {
    options_.metrics->streams_waiting_for_version().Decrement();
  }
}

void FetchLayerReactor::WriteNext() {
  if (run_ == plan_.runs.size()) {
    FinishOnce(grpc::Status::OK);
    return;
  }
  const TensorElementRange& run = plan_.runs[run_];
  const AssembledTensor& placed = store_.layout(plan_.layer).tensors()[run.tensor];
  const size_t element_bytes = DTypeSize(placed.compute_dtype);
  const uint64_t count =
      std::min(run.elements.end - next_element_, std::max<uint64_t>(1, options_.chunk_bytes / element_bytes));
  const ElementRange owned = store_.owned(plan_.layer, run.tensor);
  const float* source = store_.master(plan_.layer, run.tensor) + (next_element_ - owned.begin);

  chunk_.set_tensor(run.tensor);
  chunk_.set_element_offset(next_element_);
  std::string* data = chunk_.mutable_data();
  data->resize(count * element_bytes);
  const auto cast_start = std::chrono::steady_clock::now();
  absl::Status cast = CastFromF32(source, data->data(), count, placed.compute_dtype,
                                  store_.policy().overflow());
  options_.metrics->RecordCast(
      count, std::chrono::duration<double>(std::chrono::steady_clock::now() - cast_start).count());
  if (!cast.ok()) {
    const std::string& name = store_.model().layers[plan_.layer].tensors[run.tensor].name;
    FinishOnce(ToGrpcStatus(absl::Status(
        cast.code(), absl::StrCat("tensor ", name, " (from element ", next_element_,
                                  "): ", cast.message(),
                                  "; the policy's float16 overflow rule is 'error': set "
                                  "overflow=saturate or override this tensor to float32"))));
    return;
  }
  pending_dtype_ = placed.compute_dtype;
  pending_elements_ = count;
  next_element_ += count;
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
  options_.metrics->RecordChunkSent(pending_dtype_, pending_elements_);
  WriteNext();
}

void FetchLayerReactor::OnCancel() {
  if (wait_id_ == 0 || !gate_.Cancel(wait_id_)) return;  // streaming: OnWriteDone finishes
  StopWaiting();
  const bool expired = context_->deadline() <= std::chrono::system_clock::now();
  FinishOnce(grpc::Status(
      expired ? grpc::StatusCode::DEADLINE_EXCEEDED : grpc::StatusCode::CANCELLED,
      absl::StrCat("parameter version ", options_.min_version, " was not reached (current ",
                   gate_.version(), ") before the call ",
                   expired ? "deadline expired" : "was cancelled")));
}

void FetchLayerReactor::FinishOnce(const grpc::Status& status) {
  if (finished_.exchange(true)) return;
  final_status_ = status;
  Finish(status);
}

void FetchLayerReactor::OnDone() {
  if (options_.on_done) options_.on_done(final_status_);
  delete this;
}

}  // namespace layercast::server
