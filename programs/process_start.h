#pragma once

#include <spdlog/common.h>

namespace layercast {

// What every program does first, from its environment (read here, in the
// programs, never in the libraries): allocator and lock-order settings
// (LAYERCAST_LOCK_ORDER_CHECKS=1), failpoints (LAYERCAST_FAILPOINT,
// LAYERCAST_FAILPOINT_ONCE), logging as `program` from `level` up, and
// gRPC's own logs through ours (all of them under GRPC_TRACE or
// GRPC_VERBOSITY).
void StartProcess(const char* program, spdlog::level::level_enum level);

}  // namespace layercast
