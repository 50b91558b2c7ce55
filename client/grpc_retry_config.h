#pragma once

#include <string>

namespace layercast::client {

// The shard set's channels' service config: gRPC itself retries the
// read-only unary calls of ShardService (GetManifest, WaitVersion,
// GetCastError, GetGradientNorm) by platform::kUnaryCall: on UNAVAILABLE,
// the code of a connection that dropped or a shard that is not ready, with
// its first wait and maximum, up to its attempts. The loops above it
// (platform/retry.h) still wait out what gRPC's retries cannot: a shard
// loading for minutes, a step waiting for pushes, a publish in another's
// hands.
std::string UnaryRetryServiceConfig();

}  // namespace layercast::client
