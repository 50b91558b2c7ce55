#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace layercast::client {

// The admin token as every client path sends it ("authorization: Bearer
// <token>"): surrounding whitespace trimmed, as the shard trims its
// --admin-token-file, so a token read from a file with its newline works.
// INVALID_ARGUMENT when nothing is left, or when it holds a character a
// gRPC metadata value cannot carry or a bearer token does not hold
// (whitespace or control characters inside, non-ASCII bytes): gRPC would
// otherwise abort the process. `origin` names where the token came from.
// No message ever quotes the token.
absl::StatusOr<std::string> CleanBearerToken(absl::string_view token, absl::string_view origin);

// A token over a channel without TLS crosses the network in clear text:
// INVALID_ARGUMENT unless the caller said `insecure` (loopback tests),
// naming `insecure_switch`, the way this caller says it (`--insecure`,
// `insecure=True`).
absl::Status CheckTokenTransport(bool tls, bool insecure, absl::string_view insecure_switch);

}  // namespace layercast::client
