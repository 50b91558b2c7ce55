#include <cstdio>

#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"
#include "programs/layercast/layer_walk.h"

namespace layercast::cli {

absl::Status RunBench(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(tools::CliFlags flags,
                   tools::CliFlags::Parse(args, WithShardSetFlags({"rounds", "budget-layers"})));
  ASSIGN_OR_RETURN(uint64_t rounds, flags.GetUint("rounds", 3));
  if (rounds == 0) {
    return absl::InvalidArgumentError("--rounds must be at least 1: the walks over every layer");
  }
  ASSIGN_OR_RETURN(auto set, ConnectFromFlags(flags));
  std::vector<uint32_t> order;
  for (uint64_t r = 0; r < rounds; ++r) {
    for (uint32_t l = 0; l < set->model().layers.size(); ++l) order.push_back(l);
  }
  ASSIGN_OR_RETURN(uint64_t budget_layers, flags.GetUint("budget-layers", 3));
  ASSIGN_OR_RETURN(WalkStats stats, WalkLayers(
                                        *set, order, LayersBudget(*set, budget_layers),
                                        [](size_t) { return "bench"; },
                                        [](const client::Layer&) { return absl::OkStatus(); }));
  std::printf("gathered %u layers, %s in %.2f s: %.2f GB/s on the wire, %.2f Gparams/s\n",
              stats.layers, FormatBytes(stats.wire_bytes).c_str(), stats.seconds,
              stats.wire_bytes / stats.seconds / 1e9, stats.fp32_bytes / 4.0 / stats.seconds / 1e9);
  return absl::OkStatus();
}

}  // namespace layercast::cli
