#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/shard.pb.h"
#include "server/serving/version_gate.h"

namespace layercast::server {

// One parked WaitVersion call: answers the shard's version once it reaches
// the request's min_version, at the wait's end, or when the shard closes
// its gate. A call the client cancels withdraws its wait from the gate and
// ends at once, so the parked slot it holds is free again then, not at the
// end of the server-side wait (minutes).
//
// Owns itself: deletes itself in OnDone. The gate's answer (on the grant
// executor) and OnCancel may race; the wait id and the cancellation are
// kept under one mutex, as in PushGradientsReactor.
class WaitVersionReactor final : public grpc::ServerUnaryReactor {
 public:
  // `gate` must outlive the reactor; `on_done` is called once, from OnDone,
  // with the final status (to free the parked slot and count the call).
  WaitVersionReactor(VersionGate& gate, layercast::v1::WaitVersionResponse* response,
                     std::function<void(const grpc::Status&)> on_done);

  // Registers the wait; the call ends when it is answered or cancelled.
  void Start(uint64_t min_version, std::chrono::steady_clock::time_point give_up_at);

  void OnCancel() override;
  void OnDone() override;

 private:
  void OnVersion(VersionGate::Outcome outcome, uint64_t version);
  void FinishOnce(const grpc::Status& status);

  VersionGate& gate_;
  layercast::v1::WaitVersionResponse* const response_;
  const std::function<void(const grpc::Status&)> on_done_;

  absl::Mutex mu_;
  // The gate's id of the wait in progress; 0 before Start registers it and
  // once it is answered or withdrawn.
  uint64_t wait_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> finished_{false};
  grpc::Status final_status_;  // written before Finish, read in OnDone
};

}  // namespace layercast::server
