#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "layercast/v1/shard.pb.h"
#include "server/fetch_plan.h"
#include "server/memory_budget.h"
#include "server/parameter_store.h"
#include "server/server_metrics.h"
#include "server/shared_chunks.h"
#include "server/version_gate.h"

namespace layercast::server {

// Streams one FetchLayer call. Three steps, none of which blocks a thread:
// wait until the requested parameter version is reached; wait (in arrival
// order) for memory budget for its chunk buffers; then cast the planned runs
// chunk by chunk straight from the fp32 master into the slice that goes on
// the wire (see EncodeLayerChunk), keeping one write in flight and starting
// the next from OnWriteDone. No copy of the layer in its compute dtype ever
// exists beyond the chunks in flight.
//
// Owns itself: deletes itself in OnDone. gRPC serialises its own callbacks;
// the version gate's and the budget's callbacks may race OnCancel, and
// VersionGate::Cancel / MemoryBudget::Cancel decide which side finishes.
class FetchLayerReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  struct Options {
    uint64_t chunk_bytes = 1 << 20;
    uint64_t min_version = 0;
    // Where chunks cast by other streams are shared; null: cast every chunk
    // here.
    SharedChunks* shared = nullptr;
    // Called once from OnDone with the final status, for accounting.
    std::function<void(const grpc::Status&)> on_done;
  };

  // Everything referenced must outlive the reactor.
  FetchLayerReactor(grpc::CallbackServerContext* context, const ParameterStore& store,
                    VersionGate& gate, MemoryBudget& budget, ServerMetrics& metrics, FetchPlan plan,
                    Options options);

  // Budgeted bytes one stream of `plan` holds while it runs: its largest
  // chunk, twice, since the transport may still hold the previous chunk's
  // slice when the next one is cast.
  static uint64_t BufferBytes(const ParameterStore& store, const FetchPlan& plan,
                              uint64_t chunk_bytes);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  enum class Phase { kWaitingForVersion, kWaitingForBudget, kStreaming };

  void OnVersionReached();
  void OnBudget(bool granted);
  // Casts chunk `key` from the master into a new slice, with its CRC-32C.
  absl::StatusOr<CastChunk> Cast(const ChunkKey& key);
  // Casts (or shares) the next chunk and writes it, or finishes when the plan is done.
  void WriteNext();
  void FinishOnce(const grpc::Status& status);

  grpc::CallbackServerContext* context_;
  const ParameterStore& store_;
  VersionGate& gate_;
  MemoryBudget& budget_;
  ServerMetrics& metrics_;
  const FetchPlan plan_;
  const Options options_;
  const uint64_t buffer_bytes_;
  const std::string peer_;  // the reader, for SharedChunks

  std::atomic<Phase> phase_{Phase::kWaitingForVersion};
  std::atomic<uint64_t> version_wait_id_{0};
  std::atomic<uint64_t> budget_wait_id_{0};
  std::atomic<bool> holds_budget_{false};
  std::atomic<bool> finished_{false};

  size_t run_ = 0;             // index into plan_.runs
  uint64_t next_element_ = 0;  // next element of plan_.runs[run_] to send
  uint64_t version_ = 0;       // of the master the chunks are cast from
  grpc::ByteBuffer chunk_;     // the encoded chunk being written
  // The chunk in flight, counted as sent once its write completes.
  DType pending_dtype_ = DType::kFloat32;
  uint64_t pending_elements_ = 0;
  grpc::Status final_status_;
};

}  // namespace layercast::server
