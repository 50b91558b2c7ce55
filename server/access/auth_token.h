#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "platform/file_system.h"

namespace layercast::server {

// The bearer token that calls which write or administer a shard (the
// ShardAdmin service) must carry, as the gRPC metadata entry
// "authorization: Bearer <token>". Only the token's SHA-256 is kept, and
// tokens are compared by digest in constant time, so neither the token's
// content nor its length leaks through timing.
//
// Immutable; thread-safe.
// The token of an "authorization" metadata value "Bearer <token>" (the
// scheme in any case); nullopt when absent (nullptr) or another scheme.
std::optional<absl::string_view> BearerTokenOf(const std::string* authorization);

class AdminToken {
 public:
  // Shortest token accepted: 16 characters (e.g. `openssl rand -hex 16`
  // makes 32).
  static constexpr size_t kMinLength = 16;
  static constexpr size_t kMaxLength = 4096;

  // The content of `path` with surrounding whitespace trimmed.
  // INVALID_ARGUMENT naming the file when the token is shorter than
  // kMinLength, longer than kMaxLength, or holds whitespace or control
  // characters; the file system's code when it cannot be read.
  static absl::StatusOr<AdminToken> FromFile(const std::string& path,
                                             FileSystem& fs = DefaultFileSystem());
  // The same checks on a token given directly; `origin` names it in messages.
  static absl::StatusOr<AdminToken> FromString(absl::string_view token, absl::string_view origin);

  // Checks one call's "authorization" metadata value (nullptr: the call
  // has none). OK for "Bearer <this token>" (the scheme in any case);
  // UNAUTHENTICATED when absent or not a bearer credential; PERMISSION_DENIED
  // for another token. Each message says what to send.
  absl::Status Check(const std::string* authorization) const;
  // Whether `presented` (a bearer credential's token) is this token.
  bool Matches(absl::string_view presented) const;

 private:
  explicit AdminToken(const std::array<uint8_t, 32>& digest) : digest_(digest) {}
  std::array<uint8_t, 32> digest_;
};

}  // namespace layercast::server
