#include "server/training/push_gradients_reactor.h"

#include <grpc/grpc.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <algorithm>
#include <utility>

#include <new>

#include "absl/strings/str_cat.h"
#include "platform/byte_size.h"
#include "platform/failpoint.h"
#include "wire/grpc_status.h"
#include "wire/owned_runs.h"

namespace layercast::server {

PushGradientsReactor::PushGradientsReactor(grpc::CallbackServerContext* context,
                                           const ParameterStore& store, LayerTrainer& trainer,
                                           MemoryBudget& budget, grpc::ByteBuffer* response,
                                           Options options)
    : StreamReactor(context, *options.clock),
      store_(store),
      trainer_(trainer),
      budget_(budget),
      response_(response),
      options_(std::move(options)) {
  ReadNext();
}

void PushGradientsReactor::ReadNext() {
  StampStart();
  StartRead(&chunk_);
}

void PushGradientsReactor::OnReadDone(bool ok) {
  StampDone();
  if (!ok) {
    Complete();
    return;
  }
  absl::StatusOr<wire::GradientChunkView> view = wire::ReadGradientChunk(chunk_);
  if (!view.ok()) {
    End(view.status());
    return;
  }
  view_ = *view;
  received_bytes_ += view_.data_bytes;
  if (!begun_) {
    begun_ = true;
    Begin();
    return;
  }
  Take();
}

void PushGradientsReactor::Begin() {
  layer_ = view_.layer;
  worker_ = view_.worker;
  step_ = view_.step;
  if (options_.authorize) {
    if (absl::Status authorized = options_.authorize(worker_); !authorized.ok()) {
      End(authorized);
      return;
    }
  }
  absl::StatusOr<LayerTrainer::PushTicket> ticket = trainer_.AdmitPush(layer_, worker_, step_);
  if (!ticket.ok()) {
    End(ticket.status());
    return;
  }
  ticket_.emplace(*std::move(ticket));
  // The step's staging, for every worker's push, is reserved once; this
  // push waits for it (without blocking a thread) unless it is there.
  const grpc::Status cancelled = wire::ToGrpcStatus(
      absl::CancelledError("the push was cancelled before it was staged; nothing of it was kept"));
  bool was_cancelled = false;
  {
    absl::MutexLock lock(&mu_);
    was_cancelled = cancelled_;
    waiting_ = !cancelled_;
  }
  if (was_cancelled) {
    End(cancelled);
    return;
  }
  const uint64_t id =
      ticket_->Reserve(options_.budget_give_up_at, [this](bool granted) { OnReserved(granted); });
  bool withdrawn = false;
  {
    absl::MutexLock lock(&mu_);
    // Still waiting: the id lets OnCancel withdraw it; a cancel that came
    // before the id did is honoured here. (Once OnReserved has run, waiting_
    // is false and the id stale.)
    if (waiting_) {
      withdrawn = cancelled_ && ticket_->CancelWait(id);
      if (withdrawn) {
        waiting_ = false;
      } else {
        wait_id_ = id;
      }
    }
  }
  if (withdrawn) End(cancelled);
}

void PushGradientsReactor::OnReserved(bool granted) {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    waiting_ = false;
    wait_id_ = 0;
    if (cancelled_) {
      finish = wire::ToGrpcStatus(
          absl::CancelledError("the push was cancelled while it waited for memory budget; nothing "
                               "of it was staged"));
    } else if (!granted) {
      finish = wire::ToGrpcStatus(absl::ResourceExhaustedError(absl::StrCat(
          "no memory budget became free to stage a step of layer ", layer_, " (",
          FormatBytes(ticket_->StepBytes()), ") in time: ", FormatBytes(budget_.in_use()),
          " is in use, much of it steps waiting for other workers' pushes; retry "
          "the push, or raise --memory-budget")));
    }
  }
  if (finish) {
    End(*finish);
    return;
  }
  Stage();
}

void PushGradientsReactor::Stage() {
  absl::StatusOr<std::span<float>> staging = ticket_->Stage();
  if (!staging.ok()) {
    End(staging.status());
    return;
  }
  decoder_.emplace(
      store_.layout(layer_),
      wire::OwnedLayerRuns(store_.layout(layer_), store_.shard_index(), store_.num_shards()),
      *staging);
  Take();
}

void PushGradientsReactor::Take() {
  if (absl::Status accepted = decoder_->Accept(view_); !accepted.ok()) {
    End(accepted);
    return;
  }
  ReadNext();
}

void PushGradientsReactor::Complete() {
  if (context_->IsCancelled()) {
    End(wire::ToGrpcStatus(absl::CancelledError(
        stalled() ? "the worker sent no chunk within the shard's "
                    "--write-progress-timeout-ms; nothing of the push was staged: "
                    "push it again"
                  : "the push was cancelled before it ended; nothing of it was "
                    "staged")));
    return;
  }
  if (!begun_) {
    End(wire::ToGrpcStatus(absl::InvalidArgumentError(
        "the push carried no chunks: send every element this shard owns of "
        "the layer (its manifest's layout and the shard math say which)")));
    return;
  }
  if (!decoder_->done()) {
    End(wire::ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "the push ended before every element this shard owns of layer ", layer_, " arrived (due: ",
        decoder_->Due(), "); nothing of it was staged: push the whole layer again"))));
    return;
  }
  absl::StatusOr<LayerTrainer::Pushed> pushed = ticket_->Push();
  if (!pushed.ok()) {
    End(pushed.status());
    return;
  }
  pushed_ = *pushed;
  layercast::v1::PushGradientsResponse response;
  response.set_layer_version(pushed->layer_version);
  response.set_applied(pushed->applied);
  bool own_buffer = false;
  End(grpc::SerializationTraits<layercast::v1::PushGradientsResponse>::Serialize(
      response, response_, &own_buffer));
}

void PushGradientsReactor::OnCancel() {
  bool withdrawn = false;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    // A wait still registered is withdrawn here and this side finishes; a
    // grant already posted sees `cancelled_`; a read in flight fails.
    withdrawn = wait_id_ != 0 && ticket_->CancelWait(wait_id_);
    if (withdrawn) wait_id_ = 0;
  }
  if (withdrawn) {
    End(wire::ToGrpcStatus(
        absl::CancelledError("the push was cancelled while it waited for memory budget")));
  }
}

void PushGradientsReactor::End(const grpc::Status& status) {
  if (!ClaimFinish()) return;
  // The push ends before the worker hears the status, so that its next
  // push of the same layer is admitted. No read is in flight and nothing
  // else touches the ticket: every caller is the stream's last step.
  ticket_.reset();
  FinishClaimed(status);
}

void PushGradientsReactor::OnDone() {
  // The worker has its OK: what the shard owes it from here is in the
  // push journal.
  if (final_status().ok() && pushed_) FailPoint("step.after_push_ack", store_.shard_index());
  if (options_.on_done) options_.on_done(this, final_status(), received_bytes_, pushed_);
  delete this;
}

}  // namespace layercast::server
