#include "server/access/auth_token.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "platform/status_macros.h"
#include "server/access/auth_file.h"

namespace layercast::server {
namespace {

std::array<uint8_t, 32> Digest(absl::string_view text) {
  std::array<uint8_t, 32> digest{};
  unsigned int length = 0;
  EVP_Digest(text.data(), text.size(), digest.data(), &length, EVP_sha256(), nullptr);
  return digest;
}

}  // namespace

std::optional<absl::string_view> BearerTokenOf(const std::string* authorization) {
  constexpr absl::string_view kScheme = "bearer ";
  if (authorization == nullptr || !absl::StartsWithIgnoreCase(*authorization, kScheme)) {
    return std::nullopt;
  }
  return absl::StripAsciiWhitespace(absl::string_view(*authorization).substr(kScheme.size()));
}

absl::StatusOr<AdminToken> AdminToken::FromFile(const std::string& path, FileSystem& fs) {
  // Room for a kMaxLength token and a generous amount of surrounding space.
  ASSIGN_OR_RETURN(std::string content, ReadCredentialFile(path, "admin-token-file", 2 * kMaxLength,
                                                           CredentialKind::kSecret, fs));
  return FromString(absl::StripAsciiWhitespace(content), absl::StrCat("--admin-token-file ", path));
}

absl::StatusOr<AdminToken> AdminToken::FromString(absl::string_view token,
                                                  absl::string_view origin) {
  if (token.size() < kMinLength || token.size() > kMaxLength) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, " holds a token of ", token.size(), " characters; use ", kMinLength,
                     " to ", kMaxLength, " (e.g. `openssl rand -hex 32 > FILE`)"));
  }
  for (char c : token) {
    if (static_cast<unsigned char>(c) <= ' ' || c == 0x7F) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin,
                       " holds whitespace or control characters inside the token; a "
                       "bearer token is one word of printable characters"));
    }
  }
  return AdminToken(Digest(token));
}

bool AdminToken::Matches(absl::string_view presented) const {
  const std::array<uint8_t, 32> digest = Digest(presented);
  return CRYPTO_memcmp(digest.data(), digest_.data(), digest.size()) == 0;
}

absl::Status AdminToken::Check(const std::string* authorization) const {
  const std::optional<absl::string_view> presented = BearerTokenOf(authorization);
  if (!presented) {
    return absl::UnauthenticatedError(
        "this call needs the shard's admin token: send the metadata 'authorization: Bearer "
        "<token>' with the token from the shard's --admin-token-file (layercast: --token-file)");
  }
  if (!Matches(*presented)) {
    return absl::PermissionDeniedError(
        "the bearer token does not match this shard's --admin-token-file; send the token from "
        "that file");
  }
  return absl::OkStatus();
}

}  // namespace layercast::server
