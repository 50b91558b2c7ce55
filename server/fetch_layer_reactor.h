#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/shard.pb.h"
#include "platform/clock.h"
#include "server/cast_error_ledger.h"
#include "server/change_log.h"
#include "server/chunk_caster.h"
#include "server/fetch_plan.h"
#include "server/memory_budget.h"
#include "server/parameter_store.h"
#include "server/pinned_versions.h"
#include "server/server_metrics.h"
#include "server/shared_chunks.h"
#include "server/stream_reactor.h"
#include "server/version_gate.h"
#include "wire/delta_chunks.h"

namespace layercast::server {

// Streams one FetchLayer call. Three steps, none of which blocks a thread:
// wait until the requested parameter version is reached; wait (in arrival
// order) for memory budget for its chunk buffers; then cast the planned runs
// chunk by chunk straight from the fp32 master into the slice that goes on
// the wire (see EncodeLayerChunk), keeping one write in flight and starting
// the next from OnWriteDone. No copy of the layer in its compute dtype ever
// exists beyond the chunks in flight, but for a version the layer has moved
// past: a pinned read (or a stream a change overtook) copies its chunks
// from the version PinnedVersions kept, which a cast at that version gave.
//
// Owns itself: deletes itself in OnDone. gRPC serialises OnWriteDone and
// OnDone, but OnCancel may run beside them; the version gate's, the
// budget's and SharedChunks' callbacks are posted to the grant executor and
// may race OnCancel too: the phase, the id of the wait in
// progress and whether the call was cancelled are kept under one mutex, so
// a cancel in any phase (or between two) ends the stream exactly once. The
// reactor never calls Finish while it holds that mutex (OnDone may delete it
// at once), and it never finishes while a grant to it is still posted, so a
// grant always finds it alive.
class FetchLayerReactor final : public StreamReactor<grpc::ServerWriteReactor<grpc::ByteBuffer>> {
 public:
  struct Options {
    uint64_t chunk_bytes = 0;  // the resolved --chunk-bytes
    uint64_t min_version = 0;
    // The shard's timers' clock: the give-up times below, the budget's
    // deadline and the stall stamps the sweep reads are on it.
    const platform::Clock* clock = &platform::Clock::Steady();
    // When a stream parked for min_version gives up on the server's side
    // (--max-version-wait-ms), whatever the client's deadline.
    std::chrono::steady_clock::time_point version_give_up_at =
        std::chrono::steady_clock::time_point::max();
    // Where chunks cast by other streams are shared; null: cast every chunk
    // here.
    SharedChunks* shared = nullptr;
    // Called once from OnDone with the final status, for accounting.
    std::function<void(FetchLayerReactor*, const grpc::Status&)> on_done;
    // Called once when the version has been reached (the stream stops being
    // parked), for accounting.
    std::function<void()> on_unparked;
    // A delta pull from this version (FetchLayerRequest.base_version): what
    // changed since is read from `changes`, which must be set with it.
    std::optional<uint64_t> base_version;
    // With base_version: the reader takes positions as gaps
    // (FetchLayerRequest.accepts_changed_gaps).
    bool changed_gaps = false;
    const ChangeLog* changes = nullptr;
    // A pinned read (FetchLayerRequest.exact_version): the stream sends
    // this version, waiting for it first (min_version must be it); set
    // `changes` with it.
    std::optional<uint64_t> exact_version;
    // FetchLayerRequest.will_pull_deltas: tells `changes` (ChangeLog::
    // NoteAsked), as a delta pull or a pinned read does.
    bool will_pull_deltas = false;
    // Where versions a change superseded are kept: a stream at a version its
    // layer has moved past (pinned, or overtaken mid-layer) sends from
    // there; a pinned read leases its version there. Null: such a stream
    // ends with ABORTED.
    PinnedVersions* pinned = nullptr;
    // What each chunk's cast lost, measured once per chunk and version.
    // Null: measured, and counted in the metrics, on every cast.
    CastErrorLedger* cast_errors = nullptr;
    uint32_t cast_error_sample_every = 0;  // as ChunkCaster::Options' (0: 1)
    // The worker's last stream of this layer failed a checksum
    // (FetchLayerRequest.recast): the stream trusts no kept CRC, checksums
    // every chunk it casts, and puts that CRC in `cast_errors` in place of
    // a kept one that differs (which may be what failed).
    bool recast = false;
    // What the layer's next version waits for (LayerTrainer::WaitingFor),
    // told to a stream that gave up waiting for it. Empty: nothing to add.
    std::function<std::string(uint32_t layer)> waiting_for;
  };

  // Everything referenced must outlive the reactor.
  FetchLayerReactor(grpc::CallbackServerContext* context, const ParameterStore& store,
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
  // Casts chunk `key` from the master into a new slice, with its CRC-32C,
  // or (a delta key) into the delta chunk of its span.
  absl::StatusOr<CastChunk> Cast(const ChunkKey& key);
  // Where key.version's values are: null for the master (the layer is at
  // that version, or changed nothing since), else the version kept of it;
  // ABORTED when neither. REQUIRES: the layer's mutex held shared.
  absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> SourceOf(const ChunkKey& key);
  // For a pinned read whose layer is at `current`: holds the kept version
  // it asks for (held_) for the stream's life, so a reclaim while it waits
  // for budget cannot take it away; ABORTED, naming the version to walk
  // again at, when the shard has no such version. Takes the layer's mutex.
  std::optional<grpc::Status> HoldExactVersion(uint64_t current);
  // Leases the pinned version (PinnedVersions::Lease) for a read it serves.
  void LeaseExactVersion();
  // ABORTED for a stream in a dtype of its own at `version`, which its
  // layer (now at `current`) has left.
  absl::Status NotInThisDType(uint64_t version, uint64_t current) const;
  // A delta chunk of an 8-bit float tensor, from the span's codes and
  // scales at key.version (`quantized`) and the fp32 elements that changed
  // since the base (`changed`, rewritten to the codes that changed).
  absl::StatusOr<CastChunk> CastFp8Delta(const ChunkKey& key, const AssembledTensor& placed,
                                         const wire::DeltaSpan& span,
                                         std::span<const uint8_t> quantized,
                                         std::vector<uint64_t>& changed);
  // What an 8-bit float delta quantizes its base again from: null for the
  // master (nothing changed since the base), else the fp32 PinnedVersions
  // kept of it; OUT_OF_RANGE when that is gone. REQUIRES: the layer's
  // mutex held shared.
  absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> BaseOf(const ChunkKey& key);
  // Why a superseded version is not at hand, for messages.
  std::string WhyNotKept() const;
  absl::StatusOr<CastChunk> CastDelta(const ChunkKey& key);
  // Casts (or shares) the next chunk and writes it, or finishes when the
  // plan is done.
  void WriteNext();
  void Write(absl::StatusOr<CastChunk> chunk);
  // The status of a call that was cancelled while waiting.
  grpc::Status CancelledWhileWaiting(absl::string_view what) const;

  const ParameterStore& store_;
  VersionGate& gate_;
  MemoryBudget& budget_;
  ServerMetrics& metrics_;
  const FetchPlan plan_;
  const Options options_;
  const ChunkCaster caster_;
  const uint64_t buffer_bytes_;
  const std::string peer_;  // the reader, for SharedChunks

  absl::Mutex mu_;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kWaitingForVersion;
  uint64_t wait_id_ ABSL_GUARDED_BY(mu_) = 0;  // of the version or budget wait
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> holds_budget_{false};
  std::atomic<bool> stop_{false};
  // Counted in pinned_readers (it sent from a version its layer had left).
  std::atomic<bool> pinned_{false};
  // The kept version a pinned read sends from; set before streaming starts.
  std::shared_ptr<const PinnedVersions::Kept> held_;

  // Streaming state: touched only by the one step that runs at a time
  // (OnBudget, OnWriteDone or a SharedChunks resume).
  size_t run_ = 0;             // index into plan_.runs
  uint64_t next_element_ = 0;  // next element of plan_.runs[run_] to send
  uint64_t version_ = 0;       // of the master the chunks are cast from
  grpc::ByteBuffer chunk_;     // the encoded chunk being written
  // The chunk in flight, counted as sent once its write completes.
  DType pending_dtype_ = DType::kFloat32;
  uint64_t pending_elements_ = 0;
  uint64_t pending_bytes_ = 0;
};

}  // namespace layercast::server
