#include "server/serving/stream_registry.h"

#include <grpc/grpc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "wire/grpc_status.h"

namespace layercast::server {

StreamRegistry::StreamRegistry(Limits limits, ServerMetrics& metrics,
                               std::function<void()> on_sweep, DeadlineTimers* timers)
    : limits_(limits), metrics_(metrics), on_sweep_(std::move(on_sweep)), timers_(timers) {
  ScheduleSweep();
}

void StreamRegistry::ScheduleSweep() {
  // Four looks per timeout: a stalled call is caught within 1.25 of it.
  const auto period = std::max<std::chrono::steady_clock::duration>(
      std::chrono::milliseconds(50), limits_.write_progress_timeout / 4);
  timers_.Schedule(timers_.Now() + period, [this] { Sweep(); });
}

void StreamRegistry::Sweep() {
  if (on_sweep_) on_sweep_();
  const auto now = timers_.Now();
  // (call, why): readers that stopped draining, pushers that stopped sending.
  std::vector<std::pair<grpc_call*, const char*>> stalled;
  {
    absl::MutexLock lock(&mu_);
    for (FetchLayerReactor* stream : streams_) {
      if (grpc_call* call = stream->RefIfStalled(now, limits_.write_progress_timeout)) {
        stalled.emplace_back(call,
                             "the client did not drain a chunk within the shard's "
                             "--write-progress-timeout-ms");
      }
    }
    for (PushStream* push : pushes_) {
      if (grpc_call* call = push->RefIfStalled(now, limits_.write_progress_timeout)) {
        stalled.emplace_back(call,
                             "the worker sent no chunk within the shard's "
                             "--write-progress-timeout-ms; nothing of the push was staged");
      }
    }
  }
  // Cancelled outside the lock: gRPC may run OnCancel and OnDone, which take
  // it, on this thread. The calls' own references keep them valid even when
  // their streams finish meanwhile.
  for (const auto& [call, why] : stalled) {
    grpc_call_cancel_with_status(call, GRPC_STATUS_CANCELLED, why, nullptr);
    grpc_call_unref(call);
    metrics_.RecordStalledStream();
  }
  ScheduleSweep();
}

grpc::Status StreamRegistry::Admit(bool parked) {
  absl::MutexLock lock(&mu_);
  if (parked) {
    if (parked_ < static_cast<int64_t>(limits_.max_parked_streams)) {
      ++parked_;
      return grpc::Status::OK;
    }
    return wire::ToGrpcStatus(absl::ResourceExhaustedError(
        absl::StrCat("this shard already has ", limits_.max_parked_streams,
                     " FetchLayer streams parked for a future min_version "
                     "(--max-parked-streams); retry with backoff once its version advances")));
  }
  if (streaming_ < static_cast<int64_t>(limits_.max_streams)) {
    ++streaming_;
    return grpc::Status::OK;
  }
  return wire::ToGrpcStatus(absl::ResourceExhaustedError(
      absl::StrCat("this shard already serves ", limits_.max_streams,
                   " FetchLayer streams (--max-streams); retry with backoff, or "
                   "raise --max-streams")));
}

void StreamRegistry::Unpark() {
  absl::MutexLock lock(&mu_);
  --parked_;
  ++streaming_;
}

void StreamRegistry::Leave(bool parked) {
  absl::MutexLock lock(&mu_);
  --(parked ? parked_ : streaming_);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* StreamRegistry::OpenStream(
    bool parked, FetchLayerReactor::Options options,
    absl::FunctionRef<FetchLayerReactor*(FetchLayerReactor::Options)> make) {
  if (grpc::Status admitted = Admit(parked); !admitted.ok()) {
    metrics_.RecordRpc("FetchLayer", wire::StatusCodeName(admitted.error_code()));
    return new RefusedStream<grpc::ServerWriteReactor<grpc::ByteBuffer>>(admitted);
  }
  metrics_.streams_in_flight().Increment();
  // Whether the stream still holds a parked slot rather than a streaming one.
  auto still_parked = std::make_shared<std::atomic<bool>>(parked);
  options.on_unparked = [this, still_parked] {
    if (still_parked->exchange(false)) Unpark();
  };
  options.on_done = [this, still_parked, start = std::chrono::steady_clock::now()](
                        FetchLayerReactor* stream, const grpc::Status& status) {
    metrics_.RecordRpc("FetchLayer", wire::StatusCodeName(status.error_code()));
    if (status.ok()) {
      metrics_.RecordFetchDuration(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    metrics_.streams_in_flight().Decrement();
    RemoveStream(stream, still_parked->load());
  };
  // Registered under the lock its on_done takes: OnDone may come as soon as
  // a posted grant runs (gRPC holds a reactor's calls until FetchLayer
  // returns it, then replays them), and must find it registered.
  absl::MutexLock lock(&mu_);
  FetchLayerReactor* stream = make(std::move(options));
  streams_.insert(stream);
  return stream;
}

void StreamRegistry::RemoveStream(FetchLayerReactor* stream, bool parked) {
  absl::MutexLock lock(&mu_);
  --(parked ? parked_ : streaming_);
  streams_.erase(stream);
}

absl::StatusOr<StreamRegistry::PushStream*> StreamRegistry::AddPush(
    const std::string& peer, absl::FunctionRef<PushStream*()> make) {
  absl::MutexLock lock(&mu_);
  if (pushes_.size() >= limits_.max_push_streams) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this shard already has ", limits_.max_push_streams,
                     " PushGradients streams open (--max-push-streams); nothing of this push was "
                     "staged: retry with backoff"));
  }
  uint32_t& from_peer = pushes_by_peer_[peer];
  if (limits_.max_push_streams_per_connection > 0 &&
      from_peer >= limits_.max_push_streams_per_connection) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this connection already has ", from_peer,
        " PushGradients streams open (--max-push-streams-per-connection); nothing of this push "
        "was staged: finish a push on it before the next, or retry with backoff"));
  }
  ++from_peer;
  PushStream* push = make();
  pushes_.insert(push);
  metrics_.push_streams_in_flight().Set(static_cast<double>(pushes_.size()));
  return push;
}

void StreamRegistry::RemovePush(PushStream* push, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  pushes_.erase(push);
  if (auto it = pushes_by_peer_.find(peer); it != pushes_by_peer_.end() && --it->second == 0) {
    pushes_by_peer_.erase(it);
  }
  metrics_.push_streams_in_flight().Set(static_cast<double>(pushes_.size()));
}

grpc::Status StreamRegistry::AddWait(const std::string& peer) {
  {
    absl::MutexLock lock(&mu_);
    uint32_t& waits = waits_by_peer_[peer];
    if (waits >= limits_.max_waits_per_connection) {
      return wire::ToGrpcStatus(absl::ResourceExhaustedError(
          absl::StrCat("this connection already has ", limits_.max_waits_per_connection,
                       " WaitVersion calls waiting (--max-waits-per-connection); one at a time "
                       "sees every version: wait for it to end")));
    }
    ++waits;
  }
  grpc::Status admitted = Admit(/*parked=*/true);
  if (!admitted.ok()) ForgetWait(peer);
  return admitted;
}

void StreamRegistry::RemoveWait(const std::string& peer) {
  ForgetWait(peer);
  Leave(/*parked=*/true);
}

void StreamRegistry::ForgetWait(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  if (auto it = waits_by_peer_.find(peer); it != waits_by_peer_.end() && --it->second == 0) {
    waits_by_peer_.erase(it);
  }
}

void StreamRegistry::StopStreams() {
  absl::MutexLock lock(&mu_);
  for (FetchLayerReactor* stream : streams_) stream->StopAtNextChunk();
}

int64_t StreamRegistry::in_flight() const {
  absl::MutexLock lock(&mu_);
  return streaming_ + parked_;
}

int64_t StreamRegistry::streaming() const {
  absl::MutexLock lock(&mu_);
  return streaming_;
}

bool StreamRegistry::WaitUntilIdle(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  const auto idle = [this]()
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return streaming_ + parked_ == 0; };
  return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

}  // namespace layercast::server
