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
#include "server/layer_trainer.h"
#include "server/memory_budget.h"
#include "server/parameter_store.h"
#include "wire/gradient_chunks.h"

namespace layercast::server {

// Takes one PushGradients stream: one worker's gradient of one layer for one
// step. The first chunk names (step, worker, layer); the trainer checks them
// before anything is staged, so a wrong step or a repeated push costs one
// chunk, and a second stream of the same push while one is in flight is
// refused, so one push is staged at most once. Raw: chunks arrive as gRPC's receive buffers and are
// read in place (wire::ReadGradientChunk); the response is encoded here. The push that opens a
// layer step waits (without blocking a thread) for budget for the whole step's staging
// (LayerTrainer::StepBytes); the step's later pushes need none. wire::GradientDecoder widens every
// chunk into the push's staging, one fp32 value per element the shard owns of the layer. Only a
// stream that half-closes with every owned element covered exactly once reaches the trainer; a
// stream that fails, is cancelled or ends short leaves nothing behind (a reservation it made stays
// with its step, which returns it as it applies).
//
// Owns itself: deletes itself in OnDone. OnReadDone and the budget's grant
// never overlap (no read is in flight while the stream waits for budget);
// OnCancel may race either, so the wait in progress and the cancellation
// are kept under one mutex, as in FetchLayerReactor.
class PushGradientsReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  struct Options {
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

  // When a read has waited for the worker's next chunk longer than `limit`
  // at `now` (once per stream): a new reference to the call, for the caller
  // to cancel with grpc_call_cancel_with_status and release with
  // grpc_call_unref; null otherwise. A stream waiting for budget is not
  // idle: the wait is the shard's. Thread-safe; REQUIRES: OnDone has not run
  // (the service's watchdog calls it under the lock its on_done takes).
  grpc_call* RefIfIdle(std::chrono::steady_clock::time_point now,
                       std::chrono::steady_clock::duration limit);

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
  void FinishOnce(const grpc::Status& status);

  grpc::CallbackServerContext* const context_;
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
  std::atomic<bool> finished_{false};
  std::atomic<bool> idle_{false};
  // steady_clock ticks when the read in flight started; 0: none in flight.
  std::atomic<int64_t> read_started_{0};

  // Touched only by the one step that runs at a time (OnReadDone or the
  // budget's grant).
  grpc::ByteBuffer chunk_;
  wire::GradientChunkView view_;  // of chunk_
  bool begun_ = false;
  // The trainer took this stream in (BeginPush): FinishOnce ends it
  // (EndPush).
  bool admitted_ = false;
  uint32_t layer_ = 0;
  uint32_t worker_ = 0;
  uint64_t step_ = 0;
  uint64_t received_bytes_ = 0;
  std::vector<float> staging_;
  std::optional<wire::GradientDecoder> decoder_;
  std::optional<LayerTrainer::Pushed> pushed_;
  grpc::Status final_status_;
};

}  // namespace layercast::server
