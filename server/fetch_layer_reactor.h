#pragma once

#include <cstdint>
#include <functional>

#include <grpcpp/grpcpp.h>

#include "layercast/v1/shard.pb.h"
#include "server/fetch_plan.h"
#include "server/parameter_store.h"
#include "server/server_metrics.h"
#include "server/version_gate.h"

namespace layercast::server {

// Streams one FetchLayer call: waits (without blocking a thread) until the
// requested parameter version is reached, then casts the planned runs chunk
// by chunk straight from the fp32 master into the outgoing message, keeping
// one write in flight and starting the next from OnWriteDone. No copy of the
// layer in its compute dtype ever exists beyond the chunk being written.
//
// Owns itself: deletes itself in OnDone. gRPC serialises its callbacks; the
// only concurrent entry is the version gate's callback racing OnCancel, which
// VersionGate::Cancel arbitrates.
class FetchLayerReactor final : public grpc::ServerWriteReactor<layercast::v1::LayerChunk> {
 public:
  struct Options {
    uint64_t chunk_bytes = 1 << 20;
    uint64_t min_version = 0;
    // Called once from OnDone with the final status, for accounting.
    std::function<void(const grpc::Status&)> on_done;
    // Must outlive the reactor.
    ServerMetrics* metrics = nullptr;
  };

  // All references must outlive the reactor.
  FetchLayerReactor(grpc::CallbackServerContext* context, const ParameterStore& store,
                    VersionGate& gate, FetchPlan plan, Options options);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // Casts the next chunk and writes it, or finishes when the plan is done.
  void WriteNext();
  void FinishOnce(const grpc::Status& status);
  // Leaves the version wait (the gauge counts parked streams).
  void StopWaiting();

  grpc::CallbackServerContext* context_;
  const ParameterStore& store_;
  VersionGate& gate_;
  const FetchPlan plan_;
  const Options options_;

  uint64_t wait_id_ = 0;
  std::atomic<bool> waiting_for_version_{false};
  // The chunk in flight, counted as sent once its write completes.
  DType pending_dtype_ = DType::kFloat32;
  uint64_t pending_elements_ = 0;
  size_t run_ = 0;               // index into plan_.runs
  uint64_t next_element_ = 0;    // next element of plan_.runs[run_] to send
  layercast::v1::LayerChunk chunk_;
  grpc::Status final_status_;
  std::atomic<bool> finished_{false};
};

}  // namespace layercast::server
