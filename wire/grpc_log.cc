#include "wire/grpc_log.h"

#include <grpc/support/log.h>

#include <cstdlib>

#include "absl/strings/string_view.h"
#include "platform/log.h"

namespace layercast::wire {
namespace {

void ToLog(gpr_log_func_args* args) {
  // gRPC's ERROR lines are mostly what a caller is also told as a status
  // (a bind that failed, a peer that went away): a warning, not an error.
  spdlog::level::level_enum level = args->severity == GPR_LOG_SEVERITY_ERROR ? spdlog::level::warn
                                    : args->severity == GPR_LOG_SEVERITY_INFO
                                        ? spdlog::level::info
                                        : spdlog::level::debug;
  // A port that cannot be bound: the program says so in one line of its
  // own, naming the flag to change; gRPC's nested dump is for debugging.
  if (absl::string_view(args->message).find("No address added out of total") !=
      absl::string_view::npos) {
    level = spdlog::level::debug;
  }
  Log()->log(level, "gRPC: {} ({}:{})", args->message, args->file, args->line);
}

}  // namespace

void RouteGrpcLogs(bool grpc_traced) {
  if (grpc_traced) return;
  gpr_set_log_function(ToLog);
}

}  // namespace layercast::wire
