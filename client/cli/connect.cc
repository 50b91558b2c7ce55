#include "client/cli/connect.h"

#include "core/status_macros.h"

namespace layercast::cli {

std::set<std::string> WithShardSetFlags(std::set<std::string> own) {
  own.insert(kShardSetFlags.begin(), kShardSetFlags.end());
  return own;
}

absl::StatusOr<std::vector<std::string>> ShardAddressesFromFlags(const CliFlags& flags) {
  if (flags.Has("shards") == flags.Has("shards-pattern")) {
    return absl::InvalidArgumentError(
        "name the shards with --shards host:port,host:port,... (in shard order) or with "
        "--shards-pattern 'layercast-{i}.layercast:7070' --num-shards N");
  }
  if (flags.Has("shards")) return client::ParseShardList(flags.Get("shards"));
  ASSIGN_OR_RETURN(uint64_t num_shards, flags.GetUint("num-shards", 0));
  return client::ExpandShardPattern(flags.Get("shards-pattern"), num_shards);
}

absl::StatusOr<std::unique_ptr<client::ShardSet>> ConnectFromFlags(const CliFlags& flags) {
  ASSIGN_OR_RETURN(std::vector<std::string> addresses, ShardAddressesFromFlags(flags));
  ASSIGN_OR_RETURN(uint64_t timeout_ms, flags.GetUint("connect-timeout-ms", 30000));
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::milliseconds(timeout_ms);
  return client::ShardSet::Connect(std::move(addresses), options);
}

}  // namespace layercast::cli
