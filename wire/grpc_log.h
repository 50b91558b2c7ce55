#pragma once

namespace layercast::wire {

// Sends gRPC's own log lines (e.g. "No address added out of total 1
// resolved" when a port is taken) through the project's logger (core/log.h),
// so that they keep the program's format, JSON included, instead of gRPC's
// "E1206 ... chttp2_server.cc:1045]" on stderr. Call once at start. Does
// nothing when GRPC_TRACE or GRPC_VERBOSITY is set: gRPC's own tracing then
// writes as it always does.
void RouteGrpcLogs();

}  // namespace layercast::wire
