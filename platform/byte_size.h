#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace layercast {

// Parses a byte count: a decimal number with an optional suffix, binary
// (KiB, MiB, GiB, TiB) or decimal (KB, MB, GB, TB, and B), or a Kubernetes
// quantity's (Ki, Mi, Gi, Ti; k, M, G, T). "1.5GiB" is accepted; the result
// is rounded down to whole bytes. INVALID_ARGUMENT
// naming the text and the accepted forms; OUT_OF_RANGE above 2^64-1.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// Formats bytes for people: "17.50 GiB", "512 B".
std::string FormatBytes(uint64_t bytes);

}  // namespace layercast
