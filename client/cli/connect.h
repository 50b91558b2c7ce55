#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "client/cli/cli_flags.h"
#include "client/shard_set.h"

namespace layercast::cli {

// Connects to the shard set named by --shards (and waits up to
// --connect-timeout-ms for it to be ready).
absl::StatusOr<std::unique_ptr<client::ShardSet>> ConnectFromFlags(const CliFlags& flags);

// A walk over a model's layers as a training step makes it: forward 0..L-1,
// then backward L-1..0.
std::vector<uint32_t> ForwardBackwardOrder(uint32_t num_layers);

}  // namespace layercast::cli
