#include <cstdio>

#include "client/cast_error_report.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"

namespace layercast::cli {

absl::Status RunCastError(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(tools::CliFlags flags, tools::CliFlags::Parse(args, kShardSetFlags));
  ASSIGN_OR_RETURN(auto set, ConnectFromFlags(flags));
  ASSIGN_OR_RETURN(std::vector<client::LayerCastReport> reports,
                   client::FetchCastErrorReport(*set));
  if (reports.empty()) {
    std::printf(
        "no layer was cast to a narrower dtype since the shards started: gather a layer first\n");
    return absl::OkStatus();
  }
  std::printf("%5s %-24s %-9s %8s %12s %10s %10s %9s %10s %9s\n", "layer", "name", "dtype",
              "version", "elements", "max rel", "mean rel", "flushed", "overflowed", "subnormal");
  const ModelSpec& model = set->model();
  bool sampled = false;
  for (const client::LayerCastReport& report : reports) {
    const CastError& error = report.error;
    const std::string name =
        report.layer < model.layers.size() ? model.layers[report.layer].name : "?";
    sampled = sampled || error.sampled();
    std::printf("%5u %-24s %-9s %8llu %12llu %10.3g%s %9.3g%s %9llu %10llu %9llu%s\n", report.layer,
                name.c_str(), std::string(DTypeName(report.dtype)).c_str(),
                static_cast<unsigned long long>(report.version),
                static_cast<unsigned long long>(error.elements), error.max_relative_error,
                error.sampled() ? "*" : " ", error.MeanRelativeError(), error.sampled() ? "*" : " ",
                static_cast<unsigned long long>(error.flushed_to_zero),
                static_cast<unsigned long long>(error.overflowed),
                static_cast<unsigned long long>(error.became_subnormal),
                report.shards < set->addresses().size() ? " (from some shards only)" : "");
  }
  if (sampled) {
    std::printf(
        "* of a sample: the shards measure every element whose cast is not a normal value and "
        "one in --cast-error-sample-every of the vectors whose casts all are (each within the "
        "dtype's unit roundoff); the counts are exact\n");
  }
  return absl::OkStatus();
}

}  // namespace layercast::cli
