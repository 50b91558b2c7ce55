#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/shard.pb.h"
#include "platform/clock.h"
#include "server/serving/memory_budget.h"
#include "server/serving/parameter_store.h"
#include "server/serving/stream_reactor.h"
#include "server/training/layer_trainer.h"
#include "wire/gradient_chunks.h"

namespace layercast::server {

// Takes one PushGradients stream: one worker's gradient of one layer for one
// step. The first chunk names (step, worker, layer); the trainer checks them
// before anything is staged, so a wrong step or a repeated push costs one
// chunk, and a second stream of the same push while one is in flight is
// refused, so one push is staged at most once. Raw: chunks arrive as gRPC's receive buffers and are
// read in place (wire::ReadGradientChunk); the response is encoded here. The push that opens a
// layer step waits (without blocking a thread) for budget for the whole step's staging
// (PushTicket::StepBytes); the step's later pushes need none. wire::GradientDecoder widens every
// chunk into the push's staging, one fp32 value per element the shard owns of the layer. Only a
// stream that half-closes with every owned element covered exactly once reaches the trainer; a
// stream that fails, is cancelled or ends short leaves nothing behind (a reservation it made stays
// with its step, which returns it as it applies).
//
// Owns itself: deletes itself in OnDone. OnReadDone and the budget's grant
// never overlap (no read is in flight while the stream waits for budget);
// OnCancel may race either, so the wait in progress and the cancellation
// are kept under one mutex, as in FetchLayerReactor.
class PushGradientsReactor final : public StreamReactor<grpc::ServerReadReactor<grpc::ByteBuffer>> {
 public:
  struct Options {
    // The shard's timers' clock: the give-up time below and the stall
    // stamps the sweep reads are on it.
    const platform::Clock* clock = &platform::Clock::Steady();
    // When a stream waiting for budget gives up (RESOURCE_EXHAUSTED).
    std::chrono::steady_clock::time_point budget_give_up_at =
        std::chrono::steady_clock::time_point::max();
    // Called once from OnDone with the reactor, the final status, the
    // gradient bytes received and, if the push was taken, what the trainer
    // said.
    std::function<void(PushGradientsReactor*, const grpc::Status&, uint64_t bytes,
                       const std::optional<LayerTrainer::Pushed>&)>
        on_done;
    // Set: whether the call may push as the worker its first chunk names
    // (--worker-token-dir); checked before the trainer sees the push.
    std::function<absl::Status(uint32_t worker)> authorize;
  };

  // Everything referenced must outlive the reactor.
  PushGradientsReactor(grpc::CallbackServerContext* context, const ParameterStore& store,
                       LayerTrainer& trainer, MemoryBudget& budget, grpc::ByteBuffer* response,
                       Options options);

  // RefIfStalled (StreamReactor): a read waiting for the worker's next
  // chunk too long. A stream waiting for budget is not stalled: the wait is
  // the shard's.

  void OnReadDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // The first chunk: checks it names a push the trainer would take, then
  // asks for budget.
  void Begin();
  void OnReserved(bool granted);
  // Allocates the staging and decodes the first chunk into it.
  void Stage();
  // Decodes chunk_ and reads the next one.
  void Take();
  // Starts reading the next chunk, noting when.
  void ReadNext();
  // The stream half-closed: hands a complete push to the trainer.
  void Complete();
  // Ends the push with the trainer, then finishes the call; once.
  void End(const grpc::Status& status);
  void End(const absl::Status& status) { End(wire::ToGrpcStatus(status)); }

  const ParameterStore& store_;
  LayerTrainer& trainer_;
  MemoryBudget& budget_;
  grpc::ByteBuffer* const response_;
  const Options options_;

  absl::Mutex mu_;
  // The wait for the step's reservation in progress, and its id.
  bool waiting_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t wait_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;

  // Touched only by the one step that runs at a time (OnReadDone or the
  // budget's grant).
  grpc::ByteBuffer chunk_;
  wire::GradientChunkView view_;  // of chunk_
  bool begun_ = false;
  // The trainer took this stream in (AdmitPush) until End.
  std::optional<LayerTrainer::PushTicket> ticket_;
  uint32_t layer_ = 0;
  uint32_t worker_ = 0;
  uint64_t step_ = 0;
  uint64_t received_bytes_ = 0;
  std::optional<wire::GradientDecoder> decoder_;
  std::optional<LayerTrainer::Pushed> pushed_;
};

}  // namespace layercast::server
