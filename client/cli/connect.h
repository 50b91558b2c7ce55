#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/cli/cli_flags.h"
#include "client/shard_set.h"

namespace layercast::cli {

// The flags every command that talks to a shard set takes.
inline const std::set<std::string> kShardSetFlags = {"shards", "shards-pattern", "num-shards",
                                                     "connect-timeout-ms"};

// kShardSetFlags plus a command's own.
std::set<std::string> WithShardSetFlags(std::set<std::string> own);

// Addresses from --shards A,B,... or --shards-pattern P --num-shards N.
absl::StatusOr<std::vector<std::string>> ShardAddressesFromFlags(const CliFlags& flags);

// Connects to the shard set named by the flags above (and waits up to
// --connect-timeout-ms for it to be ready).
absl::StatusOr<std::unique_ptr<client::ShardSet>> ConnectFromFlags(const CliFlags& flags);

}  // namespace layercast::cli
