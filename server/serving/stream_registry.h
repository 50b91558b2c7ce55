#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/serving/deadline_timers.h"
#include "server/serving/fetch_layer_reactor.h"
#include "server/serving/server_metrics.h"
#include "server/serving/stream_reactor.h"

namespace layercast::server {

// The shard's calls in flight, and what they may hold: FetchLayer streams
// streaming and parked (--max-streams, --max-parked-streams), PushGradients
// streams (--max-push-streams) and per connection
// (--max-push-streams-per-connection), WaitVersion calls per connection
// (--max-waits-per-connection); every FetchLayer and PushGradients reactor
// not yet done; and a sweep, on a timer, that cancels the ones whose peer
// stopped (--write-progress-timeout-ms) and runs the service's periodic
// work. The service asks it for a slot before it builds a reactor, and a
// reactor's on_done gives the slot back.
//
// Thread-safe.
class StreamRegistry {
 public:
  // A PushGradients stream, as the registry sees it: its stall stamp.
  using PushStream = StreamReactor<grpc::ServerReadReactor<grpc::ByteBuffer>>;

  struct Limits {
    uint32_t max_streams = 0;
    uint32_t max_parked_streams = 0;
    uint32_t max_push_streams = 0;
    uint32_t max_push_streams_per_connection = 0;  // 0: no limit per connection
    uint32_t max_waits_per_connection = 0;
    std::chrono::milliseconds write_progress_timeout{0};
  };

  // `metrics` must outlive the registry. `on_sweep` runs at every sweep, on
  // the timer thread: `timers`' (the shard's, which must outlive this), or
  // one of its own when null. It must not block (DeadlineTimers).
  StreamRegistry(Limits limits, ServerMetrics& metrics, std::function<void()> on_sweep,
                 DeadlineTimers* timers = nullptr);

  // A streaming slot, or a parked one; RESOURCE_EXHAUSTED naming the flag
  // when none is free.
  grpc::Status Admit(bool parked);
  // A parked stream's version came: its slot becomes a streaming one (past
  // --max-streams for a moment when many wake at once; the budget still
  // bounds their memory).
  void Unpark();
  // Gives back a slot Admit took.
  void Leave(bool parked);

  // A FetchLayer stream: a slot (Admit), then the reactor `make` builds
  // from `options` with on_unparked and on_done set to give the slot back
  // and count the call; or, when no slot is free, a stream refused with
  // RESOURCE_EXHAUSTED naming the flag (and `make` never called).
  grpc::ServerWriteReactor<grpc::ByteBuffer>* OpenStream(
      bool parked, FetchLayerReactor::Options options,
      absl::FunctionRef<FetchLayerReactor*(FetchLayerReactor::Options)> make);
  // A stream's on_done: unregisters it and gives back its slot.
  void RemoveStream(FetchLayerReactor* stream, bool parked);

  // Registers the push `make` builds, from `peer` (the call's peer, one per
  // connection), as AddStream does; RESOURCE_EXHAUSTED (and `make` never
  // called) past --max-push-streams or --max-push-streams-per-connection.
  absl::StatusOr<PushStream*> AddPush(const std::string& peer,
                                      absl::FunctionRef<PushStream*()> make);
  void RemovePush(PushStream* push, const std::string& peer);

  // A WaitVersion call from `peer`: its place among the connection's waits
  // and a parked slot. RESOURCE_EXHAUSTED naming the flag otherwise.
  grpc::Status AddWait(const std::string& peer);
  // Gives back both.
  void RemoveWait(const std::string& peer);

  // Ends every stream in flight with UNAVAILABLE at its next chunk.
  void StopStreams();
  // FetchLayer streams in flight (parked included), and of those streaming.
  int64_t in_flight() const;
  int64_t streaming() const;
  // Waits until no stream is in flight or `deadline` passes; true if none is.
  bool WaitUntilIdle(absl::Time deadline) const;

 private:
  // Takes `peer`'s WaitVersion off its count.
  void ForgetWait(const std::string& peer);
  // Cancels stalled calls, runs on_sweep_ and schedules the next sweep.
  void Sweep();
  void ScheduleSweep();

  const Limits limits_;
  ServerMetrics& metrics_;
  const std::function<void()> on_sweep_;
  mutable absl::Mutex mu_;
  int64_t streaming_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t parked_ ABSL_GUARDED_BY(mu_) = 0;
  // A reactor leaves these in its on_done, under the lock, before it
  // deletes itself, so the sweep and StopStreams may call into any reactor
  // they find here while they hold the lock.
  absl::flat_hash_set<FetchLayerReactor*> streams_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<PushStream*> pushes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint32_t> waits_by_peer_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint32_t> pushes_by_peer_ ABSL_GUARDED_BY(mu_);
  DeadlineTimers timers_;  // last: see DeadlineTimers
};

}  // namespace layercast::server
