#include "server/push_gradients_reactor.h"

#include <new>

#include "absl/strings/str_cat.h"
#include "core/byte_size.h"
#include "wire/grpc_status.h"
#include "wire/owned_runs.h"

namespace layercast::server {

PushGradientsReactor::PushGradientsReactor(grpc::CallbackServerContext* context,
                                           const ParameterStore& store, LayerTrainer& trainer,
                                           MemoryBudget& budget,
                                           layercast::v1::PushGradientsResponse* response,
                                           Options options)
    : context_(context),
      store_(store),
      trainer_(trainer),
      budget_(budget),
      response_(response),
      options_(std::move(options)) {
  StartRead(&chunk_);
}

void PushGradientsReactor::OnReadDone(bool ok) {
  if (!ok) {
    Complete();
    return;
  }
  received_bytes_ += chunk_.data().size();
  if (!begun_) {
    begun_ = true;
    Begin();
    return;
  }
  Take();
}

void PushGradientsReactor::Begin() {
  layer_ = chunk_.layer();
  worker_ = chunk_.worker();
  step_ = chunk_.step();
  if (absl::Status check = trainer_.CheckPush(layer_, worker_, step_); !check.ok()) {
    FinishOnce(wire::ToGrpcStatus(check));
    return;
  }
  staging_bytes_ = trainer_.StagingBytes(layer_);
  if (!budget_.Grantable(staging_bytes_)) {
    const std::optional<uint64_t> budget = budget_.budget();
    FinishOnce(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("staging this push of layer ", layer_, " takes ", FormatBytes(staging_bytes_),
                     ", more than the shard's budget of ",
                     budget ? FormatBytes(*budget) : "unlimited",
                     " leaves beside its master and optimizer state; raise --memory-budget")));
    return;
  }
  absl::MutexLock lock(&mu_);
  // Posted, never run here: no read is in flight until it runs.
  wait_id_ = budget_.Acquire(staging_bytes_, options_.budget_give_up_at,
                             [this](bool granted) { OnBudget(granted); });
}

void PushGradientsReactor::OnBudget(bool granted) {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    wait_id_ = 0;
    holds_budget_ = granted;
    if (cancelled_) {
      finish = grpc::Status(grpc::StatusCode::CANCELLED,
                            "the push was cancelled while it waited for memory budget; nothing "
                            "of it was staged");
    } else if (!granted) {
      finish = grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat("no memory budget became free to stage this push of layer ", layer_, " (",
                       FormatBytes(staging_bytes_), ") in time: ", FormatBytes(budget_.in_use()),
                       " is in use, much of it pushes waiting for other workers; retry the "
                       "push, or raise --memory-budget"));
    }
  }
  if (finish) {
    FinishOnce(*finish);
    return;
  }
  try {
    staging_.resize(trainer_.owned_elements(layer_));
  } catch (const std::bad_alloc&) {
    FinishOnce(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat("out of memory for ", FormatBytes(staging_bytes_),
                                         " of gradient staging; retry later")));
    return;
  }
  decoder_.emplace(
      store_.layout(layer_),
      wire::OwnedLayerRuns(store_.layout(layer_), store_.shard_index(), store_.num_shards()),
      std::span<float>(staging_));
  Take();
}

void PushGradientsReactor::Take() {
  if (absl::Status accepted = decoder_->Accept(chunk_); !accepted.ok()) {
    FinishOnce(wire::ToGrpcStatus(accepted));
    return;
  }
  StartRead(&chunk_);
}

void PushGradientsReactor::Complete() {
  if (context_->IsCancelled()) {
    FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED,
                            "the push was cancelled before it ended; nothing of it was staged"));
    return;
  }
  if (!begun_) {
    FinishOnce(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "the push carried no chunks: send every element this shard owns of "
                            "the layer (its manifest's layout and the shard math say which)"));
    return;
  }
  if (!decoder_->done()) {
    FinishOnce(
        grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                     absl::StrCat("the push ended before every element this shard owns of layer ",
                                  layer_, " arrived (due: ", decoder_->Due(),
                                  "); nothing of it was staged: push the whole layer again")));
    return;
  }
  absl::StatusOr<LayerTrainer::Pushed> pushed =
      trainer_.Push(layer_, worker_, step_, std::move(staging_));
  if (!pushed.ok()) {
    FinishOnce(wire::ToGrpcStatus(pushed.status()));
    return;
  }
  holds_budget_ = false;  // the trainer's now
  pushed_ = *pushed;
  response_->set_layer_version(pushed->layer_version);
  response_->set_applied(pushed->applied);
  FinishOnce(grpc::Status::OK);
}

void PushGradientsReactor::OnCancel() {
  bool withdrawn = false;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    // A wait still registered is withdrawn here and this side finishes; a
    // grant already posted sees `cancelled_`; a read in flight fails.
    withdrawn = wait_id_ != 0 && budget_.Cancel(wait_id_);
    if (withdrawn) wait_id_ = 0;
  }
  if (withdrawn) {
    FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED,
                            "the push was cancelled while it waited for memory budget"));
  }
}

void PushGradientsReactor::FinishOnce(const grpc::Status& status) {
  if (finished_.exchange(true)) return;
  final_status_ = status;
  Finish(status);
}

void PushGradientsReactor::OnDone() {
  if (holds_budget_) budget_.Release(staging_bytes_);
  if (options_.on_done) options_.on_done(final_status_, received_bytes_, pushed_);
  delete this;
}

}  // namespace layercast::server
