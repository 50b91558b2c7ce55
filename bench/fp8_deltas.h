#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace layercast::bench {

// delta_bench --fp8: the bytes of fp8 delta pulls from real read-only
// shards on 127.0.0.1, per update, against the ideal (changed scales x 4 B
// + changed codes x 1 B + their positions, each the smaller of a bitmap and
// LEB128 gaps, counted here from quantizing both versions), against a full
// fp8 pull, and against a bf16 delta of the same update from a bf16 set
// beside it. Updates: torch-exact AdamW steps at lr 1e-5 and 1e-4 (every
// fp32 value moves), and publishes that move 1% and 5% of the values.
// Goals: delta / ideal <= 1.2 for every update, and <= 0.15 of a full fp8
// pull for the AdamW steps. Prints the table and whether the goals are met.
// `token` is the shards' admin token, in `token_file`.
absl::Status RunFp8Deltas(uint32_t num_shards, const std::string& synthetic, uint64_t steps,
                          const std::string& token, const std::string& token_file);

}  // namespace layercast::bench
