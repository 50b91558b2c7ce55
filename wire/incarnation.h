#pragma once

#include <cstdint>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"

namespace layercast::wire {

// The initial-metadata key under which a shard names, on every FetchLayer
// stream, its incarnation (Manifest.incarnation, decimal): the worker sends
// it back as FetchLayerRequest.base_incarnation with its next delta of the
// layer.
inline constexpr char kIncarnationMetadata[] = "layercast-incarnation";

// The incarnation in a metadata value; nullopt for anything but a nonzero
// decimal.
inline std::optional<uint64_t> ParseIncarnation(absl::string_view value) {
  uint64_t incarnation = 0;
  if (!absl::SimpleAtoi(value, &incarnation) || incarnation == 0) return std::nullopt;
  return incarnation;
}

}  // namespace layercast::wire
