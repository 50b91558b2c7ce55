#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace layercast::server {

// The one place the server turns an absl::Status into a grpc::Status. The
// codes are the same numbers; the message is kept.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace layercast::server
