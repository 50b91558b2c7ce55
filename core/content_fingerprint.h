#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "core/parameter_source.h"

namespace layercast {

// Values read per tensor for a content fingerprint, spread evenly over it.
inline constexpr uint64_t kFingerprintSamples = 32;

// Which model's values a shard serves, the same on every shard of a set
// without any shard reading more than a few bytes of each tensor: SHA-256
// over every tensor's name and shape and the fp32 bits of
// kFingerprintSamples of its elements (element floor(j*n/S) for j < S).
// Two checkpoints of one layout (two training steps, two fine-tunes) differ
// in nearly every element, so in the fingerprint; two models that differ
// only outside the sampled elements are not told apart.
absl::StatusOr<ContentFingerprint> SampleFingerprint(const ParameterSource& source);

// Lowercase hex of the first `bytes` bytes, for messages.
std::string FingerprintHex(const ContentFingerprint& fingerprint, size_t bytes = 32);

// Parses 64 hex digits; nullopt for anything else.
std::optional<ContentFingerprint> ParseFingerprintHex(const std::string& hex);

}  // namespace layercast
