#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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

// An incarnation as people read it, in logs, errors, metrics labels and
// `layercast manifest`: 16 hex digits.
inline std::string IncarnationName(uint64_t incarnation) {
  return absl::StrCat(absl::Hex(incarnation, absl::kZeroPad16));
}

// Whether two lists of incarnations (per shard, as a gather reports the
// streams that served a layer) name different starts of some shard, so
// that the same version number may name other bits: 0 is not known, and
// differs from nothing.
inline bool OtherIncarnations(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  for (size_t shard = 0; shard < a.size() && shard < b.size(); ++shard) {
    if (a[shard] != 0 && b[shard] != 0 && a[shard] != b[shard]) return true;
  }
  return false;
}

}  // namespace layercast::wire
