#include "programs/process_start.h"

#include <cstdlib>
#include <string_view>

#include "platform/failpoint.h"
#include "platform/log.h"
#include "platform/process_tuning.h"
#include "wire/grpc_log.h"

namespace layercast {

void StartProcess(const char* program, spdlog::level::level_enum level) {
  const char* lock_order_checks = std::getenv("LAYERCAST_LOCK_ORDER_CHECKS");
  TuneOwnProcess(lock_order_checks != nullptr && std::string_view(lock_order_checks) == "1");
  ArmFailPoints(std::getenv("LAYERCAST_FAILPOINT"), std::getenv("LAYERCAST_FAILPOINT_ONCE"));
  ConfigureLogging(program, LogFormat::kText, level);
  wire::RouteGrpcLogs(std::getenv("GRPC_TRACE") != nullptr ||
                      std::getenv("GRPC_VERBOSITY") != nullptr);
}

}  // namespace layercast
