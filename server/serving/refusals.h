#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "wire/grpc_status.h"

namespace layercast::server {

// The shard's two refusals of a call it cannot serve yet, or any more,
// worded once: UNAVAILABLE, which every client of the shard retries.

// Parameters not loaded yet.
inline constexpr char kLoadingMessage[] =
    "this shard is still loading its parameters; retry shortly (the readiness health check turns "
    "SERVING when it is done)";

// Draining for shutdown; `what_now` says what became of the call and what
// the caller does next. `server`: "shard", or "relay" for the serving core
// on a relay.
inline std::string ShuttingDownMessage(absl::string_view what_now,
                                       absl::string_view server = "shard") {
  return absl::StrCat("this ", server, " is shutting down: ", what_now);
}

inline grpc::Status LoadingRefusal() {
  return wire::ToGrpcStatus(absl::UnavailableError(kLoadingMessage));
}
inline grpc::Status ShuttingDownRefusal(absl::string_view what_now,
                                        absl::string_view server = "shard") {
  return wire::ToGrpcStatus(absl::UnavailableError(ShuttingDownMessage(what_now, server)));
}

}  // namespace layercast::server
