#include "client/cli/connect.h"

#include "core/status_macros.h"

namespace layercast::cli {

absl::StatusOr<std::unique_ptr<client::ShardSet>> ConnectFromFlags(const CliFlags& flags) {
  if (!flags.Has("shards")) {
    return absl::InvalidArgumentError("--shards host:port,host:port,... is required");
  }
  ASSIGN_OR_RETURN(std::vector<std::string> addresses,
                   client::ParseShardList(flags.Get("shards")));
  ASSIGN_OR_RETURN(uint64_t timeout_ms, flags.GetUint("connect-timeout-ms", 30000));
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::milliseconds(timeout_ms);
  return client::ShardSet::Connect(std::move(addresses), options);
}

std::vector<uint32_t> ForwardBackwardOrder(uint32_t num_layers) {
  std::vector<uint32_t> order;
  for (uint32_t l = 0; l < num_layers; ++l) order.push_back(l);
  for (uint32_t l = num_layers; l-- > 0;) order.push_back(l);
  return order;
}

}  // namespace layercast::cli
