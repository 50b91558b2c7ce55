#include "client/bearer_token.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace layercast::client {

absl::StatusOr<std::string> CleanBearerToken(absl::string_view token, absl::string_view origin) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(token);
  if (trimmed.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, " is empty: give the token from the shards' --admin-token-file"));
  }
  for (size_t i = 0; i < trimmed.size(); ++i) {
    const auto c = static_cast<unsigned char>(trimmed[i]);
    // Visible ASCII only: what a header value carries and a token holds.
    if (c <= 0x20 || c >= 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, " holds a character a bearer token cannot (byte ", i, " of ",
                       trimmed.size(), " is ",
                       c < 0x20 || c == 0x7f ? "a control character"
                       : c == 0x20           ? "a space"
                                             : "not ASCII",
                       "): give the one word of the shards' --admin-token-file"));
    }
  }
  return std::string(trimmed);
}

absl::Status CheckTokenTransport(bool tls, bool insecure, absl::string_view insecure_switch) {
  if (tls || insecure) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the admin token would cross the network in clear text: connect to the shards over TLS "
      "(the CA of their --tls-cert-file, e.g. --tls-ca-file CA.pem), or pass ",
      insecure_switch, " to send it without TLS (loopback testing only)"));
}

}  // namespace layercast::client
