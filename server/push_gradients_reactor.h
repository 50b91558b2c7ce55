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
// chunk. Then the stream waits (without blocking a thread) for budget for
// its staging, one fp32 value per element the shard owns of the layer, and
// wire::GradientDecoder widens every chunk into it. Only a stream that
// half-closes with every owned element covered exactly once reaches the
// trainer; a stream that fails, is cancelled or ends short leaves nothing
// behind, and its budget is returned in OnDone. Once the trainer has taken
// the push, the staging and its charge are the trainer's.
//
// Owns itself: deletes itself in OnDone. OnReadDone and the budget's grant
// never overlap (no read is in flight while the stream waits for budget);
// OnCancel may race either, so the wait in progress and the cancellation
// are kept under one mutex, as in FetchLayerReactor.
class PushGradientsReactor final : public grpc::ServerReadReactor<layercast::v1::GradientChunk> {
 public:
  struct Options {
    // When a stream waiting for budget gives up (RESOURCE_EXHAUSTED).
    std::chrono::steady_clock::time_point budget_give_up_at =
        std::chrono::steady_clock::time_point::max();
    // Called once from OnDone with the final status, the gradient bytes
    // received and, if the push was taken, what the trainer said.
    std::function<void(const grpc::Status&, uint64_t bytes,
                       const std::optional<LayerTrainer::Pushed>&)>
        on_done;
  };

  // Everything referenced must outlive the reactor.
  PushGradientsReactor(grpc::CallbackServerContext* context, const ParameterStore& store,
                       LayerTrainer& trainer, MemoryBudget& budget,
                       layercast::v1::PushGradientsResponse* response, Options options);

  void OnReadDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // The first chunk: checks it names a push the trainer would take, then
  // asks for budget.
  void Begin();
  void OnBudget(bool granted);
  // Decodes chunk_ and reads the next one.
  void Take();
  // The stream half-closed: hands a complete push to the trainer.
  void Complete();
  void FinishOnce(const grpc::Status& status);

  grpc::CallbackServerContext* const context_;
  const ParameterStore& store_;
  LayerTrainer& trainer_;
  MemoryBudget& budget_;
  layercast::v1::PushGradientsResponse* const response_;
  const Options options_;

  absl::Mutex mu_;
  uint64_t wait_id_ ABSL_GUARDED_BY(mu_) = 0;  // of the budget wait in progress
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> holds_budget_{false};
  std::atomic<bool> finished_{false};

  // Touched only by the one step that runs at a time (OnReadDone or the
  // budget's grant).
  layercast::v1::GradientChunk chunk_;
  bool begun_ = false;
  uint32_t layer_ = 0;
  uint32_t worker_ = 0;
  uint64_t step_ = 0;
  uint64_t staging_bytes_ = 0;
  uint64_t received_bytes_ = 0;
  std::vector<float> staging_;
  std::optional<wire::GradientDecoder> decoder_;
  std::optional<LayerTrainer::Pushed> pushed_;
  grpc::Status final_status_;
};

}  // namespace layercast::server
