#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace layercast {

// The name and value of the flag at args[*i], `--name=VALUE` or
// `--name VALUE` (then *i moves past VALUE): the one spelling rule the
// shard's flags and the tool's share. INVALID_ARGUMENT "flag --name needs a
// value" when none follows. REQUIRES: args[*i] starts with "--".
absl::StatusOr<std::pair<std::string, std::string>> TakeFlag(const std::vector<std::string>& args,
                                                             size_t* i);

}  // namespace layercast
