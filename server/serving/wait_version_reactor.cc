#include "server/serving/wait_version_reactor.h"

#include <utility>

#include "server/serving/refusals.h"
#include "wire/grpc_status.h"

namespace layercast::server {
namespace {

const grpc::Status kCancelled = wire::ToGrpcStatus(
    absl::CancelledError("the wait was cancelled by the client; its slot is free again"));

}  // namespace

WaitVersionReactor::WaitVersionReactor(VersionGate& gate,
                                       layercast::v1::WaitVersionResponse* response,
                                       std::function<void(const grpc::Status&)> on_done)
    : gate_(gate), response_(response), on_done_(std::move(on_done)) {}

void WaitVersionReactor::Start(uint64_t min_version,
                               std::chrono::steady_clock::time_point give_up_at) {
  // The gate posts its answer, never runs it here, so wait_id_ is set
  // below before OnVersion can clear it.
  const uint64_t id = gate_.Wait(
      min_version, give_up_at,
      [this](VersionGate::Outcome outcome, uint64_t version) { OnVersion(outcome, version); });
  bool withdrawn = false;
  {
    absl::MutexLock lock(&mu_);
    // A cancel that came before the id did is honoured here.
    if (cancelled_) {
      withdrawn = gate_.Cancel(id);
    } else {
      wait_id_ = id;
    }
  }
  if (withdrawn) FinishOnce(kCancelled);
}

void WaitVersionReactor::OnVersion(VersionGate::Outcome outcome, uint64_t version) {
  {
    absl::MutexLock lock(&mu_);
    wait_id_ = 0;
  }
  response_->set_version(version);
  FinishOnce(outcome == VersionGate::Outcome::kClosed
                 ? ShuttingDownRefusal("wait on its replacement")
                 : grpc::Status::OK);
}

void WaitVersionReactor::OnCancel() {
  bool withdrawn = false;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    withdrawn = wait_id_ != 0 && gate_.Cancel(wait_id_);
    if (withdrawn) wait_id_ = 0;
  }
  if (withdrawn) FinishOnce(kCancelled);
}

void WaitVersionReactor::FinishOnce(const grpc::Status& status) {
  if (finished_.exchange(true)) return;
  final_status_ = status;
  Finish(status);
}

void WaitVersionReactor::OnDone() {
  if (on_done_) on_done_(final_status_);
  delete this;
}

}  // namespace layercast::server
