#pragma once

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "absl/status/status.h"
#include "platform/clock.h"
#include "server/serving/server_metrics.h"
#include "wire/grpc_status.h"

namespace layercast::server {

// What the shard's two streaming reactors (FetchLayerReactor, a write
// reactor, and PushGradientsReactor, a read reactor) share: the call is
// finished once whoever gets there first, with a status a caller may give as
// absl's; and a stamp of when the transfer in flight (a chunk written to the
// worker, or one awaited from it) started, which StreamRegistry's sweep
// reads to cancel a call whose peer stopped.
template <typename GrpcReactor>
class StreamReactor : public GrpcReactor {
 public:
  // When the transfer in flight has taken longer than `limit` at `now`
  // (once per stream): a new reference to the call, for the caller to
  // cancel with grpc_call_cancel_with_status and release with
  // grpc_call_unref. The transfer then fails, the reactor finishes, and
  // OnDone gives back what it held. A reference to the call, not to the
  // reactor: gRPC frees the call's context right after OnDone, which may
  // come first, and cancelling a finished call does nothing. Null
  // otherwise. Thread-safe; REQUIRES: OnDone has not run (StreamRegistry
  // calls it under the lock the reactor's on_done takes).
  grpc_call* RefIfStalled(std::chrono::steady_clock::time_point now,
                          std::chrono::steady_clock::duration limit) {
    const int64_t started = started_.load();
    if (started == 0 || now.time_since_epoch().count() - started <= limit.count()) return nullptr;
    if (stalled_.exchange(true)) return nullptr;
    grpc_call* call = context_->c_call();
    grpc_call_ref(call);
    return call;
  }

 protected:
  // `clock`: the one the sweep reads its `now` from; it must outlive this.
  explicit StreamReactor(grpc::CallbackServerContext* context,
                         const platform::Clock& clock = platform::Clock::Steady())
      : context_(context), clock_(clock) {}

  // A transfer starts now; its end (StampDone) clears the stamp.
  void StampStart() { started_ = std::max<int64_t>(1, clock_.Now().time_since_epoch().count()); }
  void StampDone() { started_ = 0; }
  // Whether the sweep found the call stalled (its status says so).
  bool stalled() const { return stalled_.load(); }

  // The first caller wins: true for it, which must then call
  // FinishClaimed; false for every later one. For a reactor with work to do
  // between the two (PushGradientsReactor ends its push first).
  bool ClaimFinish() { return !finished_.exchange(true); }
  void FinishClaimed(const grpc::Status& status) {
    final_status_ = status;
    this->Finish(status);
  }
  void FinishOnce(const grpc::Status& status) {
    if (ClaimFinish()) FinishClaimed(status);
  }
  void FinishOnce(const absl::Status& status) { FinishOnce(wire::ToGrpcStatus(status)); }
  // What the call finished with; for OnDone.
  const grpc::Status& final_status() const { return final_status_; }

  grpc::CallbackServerContext* const context_;

 private:
  const platform::Clock& clock_;
  std::atomic<bool> finished_{false};
  std::atomic<bool> stalled_{false};
  // clock_'s ticks when the transfer in flight started; 0: none.
  std::atomic<int64_t> started_{0};
  grpc::Status final_status_;
};

// A streaming call refused before it starts: it only finishes with
// `status`. For FetchLayer (a write reactor) and PushGradients (a read one).
template <typename GrpcReactor>
class RefusedStream final : public GrpcReactor {
 public:
  explicit RefusedStream(const grpc::Status& status) { this->Finish(status); }
  void OnDone() override { delete this; }
};

// Answers a unary call of `method` with `status` at once and counts it
// (layercast_rpcs_total): for a shard's and a relay's calls alike.
inline grpc::ServerUnaryReactor* FinishUnary(ServerMetrics& metrics,
                                             grpc::CallbackServerContext* context,
                                             const char* method, const grpc::Status& status) {
  metrics.RecordRpc(method, wire::StatusCodeName(status.error_code()));
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

}  // namespace layercast::server
