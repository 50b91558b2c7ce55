#pragma once

#include <string>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace layercast::wire {

// The one place a status crosses between absl (inside both sides) and gRPC
// (on the wire). The codes are the same numbers in both; the message is kept.
grpc::Status ToGrpcStatus(const absl::Status& status);

// A status of this process's own in gRPC's form (a refusal it built for a
// caller) back in absl's: the code and the message as they are.
absl::Status FromGrpcStatus(const grpc::Status& status);

// A status a peer answered with, its message prefixed with who answered:
// "<who>: <message>", e.g. "shard 1 (host:port): this shard is draining ...".
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view who);

// The code's canonical name ("OK", "RESOURCE_EXHAUSTED"): metric labels.
std::string StatusCodeName(grpc::StatusCode code);

}  // namespace layercast::wire
