#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "platform/clock.h"
#include "server/serving/chunk_source.h"
#include "server/serving/fetch_plan.h"
#include "server/serving/memory_budget.h"
#include "server/serving/server_metrics.h"
#include "server/serving/shared_chunks.h"
#include "server/serving/stream_reactor.h"
#include "server/serving/version_gate.h"

namespace layercast::server {

// Streams one FetchLayer call, on a shard or a relay alike. Three steps,
// none of which blocks a thread: wait until the layer reaches the
// requested version (`gate`); wait (in arrival order) for memory budget for
// its chunk buffers; then take the planned runs chunk by chunk from its
// ChunkSource (a shard casts them from its master, a relay sends what its
// mirror pulled), keeping one write in flight and starting the next from
// OnWriteDone.
//
// Owns itself: deletes itself in OnDone. gRPC serialises OnWriteDone and
// OnDone, but OnCancel may run beside them; the version gate's, the
// budget's and the source's resumptions are posted to the grant executor
// and may race OnCancel too: the phase, the id of the wait in progress and
// whether the call was cancelled are kept under one mutex, so a cancel in
// any phase (or between two) ends the stream exactly once. The reactor
// never calls Finish while it holds that mutex (OnDone may delete it at
// once), and it never finishes while a grant to it is still posted, so a
// grant always finds it alive.
class FetchLayerReactor final : public StreamReactor<grpc::ServerWriteReactor<grpc::ByteBuffer>> {
 public:
  struct Options {
    uint64_t chunk_bytes = 0;  // the chunk grid: --chunk-bytes, or the shard's for a relay
    uint64_t min_version = 0;
    // The timers' clock: the give-up times below, the budget's deadline and
    // the stall stamps the sweep reads are on it.
    const platform::Clock* clock = &platform::Clock::Steady();
    // When a stream parked for min_version gives up on the server's side
    // (--max-version-wait-ms), whatever the client's deadline.
    std::chrono::steady_clock::time_point version_give_up_at =
        std::chrono::steady_clock::time_point::max();
    // Called once from OnDone with the final status, for accounting.
    std::function<void(FetchLayerReactor*, const grpc::Status&)> on_done;
    // Called once when the version has been reached (the stream stops being
    // parked), for accounting.
    std::function<void()> on_unparked;
    // A delta pull from this version (FetchLayerRequest.base_version), and
    // whether the reader takes positions as gaps (accepts_changed_gaps).
    std::optional<uint64_t> base_version;
    bool changed_gaps = false;
    // What `gate` counts past the versions it stands for: a relay's counts
    // a held layer's version plus one, so that 0 is "nothing held yet".
    uint64_t gate_offset = 0;
    // Who serves, in messages: "shard" or "relay".
    const char* server = "shard";
  };

  // Everything referenced must outlive the reactor; it owns `source`.
  FetchLayerReactor(grpc::CallbackServerContext* context, std::unique_ptr<ChunkSource> source,
                    VersionGate& gate, MemoryBudget& budget, ServerMetrics& metrics, FetchPlan plan,
                    Options options);

  // RefIfStalled (StreamReactor): a write in flight too long.
  // Ends the stream with UNAVAILABLE at its next chunk boundary, so the
  // worker resumes the rest elsewhere (the drain timeout has passed).
  // Thread-safe.
  void StopAtNextChunk() { stop_ = true; }

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  enum class Phase { kWaitingForVersion, kWaitingForBudget, kStreaming };

  void OnVersion(VersionGate::Outcome outcome, uint64_t version);
  void OnBudget(bool granted);
  // Takes (or waits for) the next chunk and writes it, or finishes when the
  // plan is done.
  void WriteNext();
  void Write(absl::StatusOr<CastChunk> chunk);
  // The status of a call that was cancelled while waiting.
  grpc::Status CancelledWhileWaiting(absl::string_view what) const;

  std::unique_ptr<ChunkSource> source_;
  VersionGate& gate_;
  MemoryBudget& budget_;
  ServerMetrics& metrics_;
  const FetchPlan plan_;
  const Options options_;
  const uint64_t buffer_bytes_;

  absl::Mutex mu_;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kWaitingForVersion;
  uint64_t wait_id_ ABSL_GUARDED_BY(mu_) = 0;  // of the version or budget wait
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> holds_budget_{false};
  std::atomic<bool> stop_{false};

  // Streaming state: touched only by the one step that runs at a time
  // (OnBudget, OnWriteDone or a source's resumption).
  size_t run_ = 0;             // index into plan_.runs
  uint64_t next_element_ = 0;  // next element of plan_.runs[run_] to send
  uint64_t version_ = 0;       // the version the chunks are of
  grpc::ByteBuffer chunk_;     // the encoded chunk being written
  // The chunk in flight, counted as sent once its write completes.
  DType pending_dtype_ = DType::kFloat32;
  uint64_t pending_elements_ = 0;
  uint64_t pending_bytes_ = 0;
};

}  // namespace layercast::server
