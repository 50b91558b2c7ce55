#pragma once

namespace layercast::wire {

// Sends gRPC's own log lines (e.g. "No address added out of total 1
// resolved" when a port is taken) through the project's logger (platform/log.h),
// so that they keep the program's format, JSON included, instead of gRPC's
// "E1206 ... chttp2_server.cc:1045]" on stderr. Call once at start. A
// program whose user is tracing gRPC (GRPC_TRACE or GRPC_VERBOSITY set)
// passes `grpc_traced` and keeps gRPC's own lines, unfiltered by its log
// level: this call then does nothing.
void RouteGrpcLogs(bool grpc_traced);

}  // namespace layercast::wire
