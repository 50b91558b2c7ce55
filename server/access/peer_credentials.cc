#include "server/access/peer_credentials.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "server/access/auth_file.h"

namespace layercast::server {
namespace {

constexpr uint64_t kMaxCredentialBytes = 1 << 20;

}  // namespace

absl::StatusOr<PeerCalls> PeerCallsFromConfig(const layercast::v1::ShardConfig& config,
                                              absl::string_view flag) {
  PeerCalls calls;
  ASSIGN_OR_RETURN(const std::string token,
                   ReadCredentialFile(config.admin_token_file(), "admin-token-file",
                                      kMaxCredentialBytes, CredentialKind::kSecret));
  calls.token = std::string(absl::StripAsciiWhitespace(token));
  if (config.tls_cert_file().empty()) {
    // As the client tools refuse to without --insecure: a token in clear
    // text is for a network the operator vouches for, never a default.
    if (!config.peers_insecure()) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag,
          " with --admin-token-file and no --tls-cert-file: this shard would send its admin "
          "token to its peers in clear text; serve TLS (--tls-cert-file, --tls-key-file, "
          "--peer-tls-ca-file), or pass --peers-insecure where the network between the shards "
          "is trusted"));
    }
    Log()->warn("--peers-insecure: the admin token goes to the peers in clear text");
    calls.credentials = grpc::InsecureChannelCredentials();
    return calls;
  }
  grpc::SslCredentialsOptions ssl;
  ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                   ReadCredentialFile(config.tls_cert_file(), "tls-cert-file", kMaxCredentialBytes,
                                      CredentialKind::kPublic));
  ASSIGN_OR_RETURN(ssl.pem_private_key,
                   ReadCredentialFile(config.tls_key_file(), "tls-key-file", kMaxCredentialBytes,
                                      CredentialKind::kSecret));
  const bool own_ca = !config.peer_tls_ca_file().empty();
  if (own_ca || !config.tls_client_ca_file().empty()) {
    ASSIGN_OR_RETURN(
        ssl.pem_root_certs,
        ReadCredentialFile(own_ca ? config.peer_tls_ca_file() : config.tls_client_ca_file(),
                           own_ca ? "peer-tls-ca-file" : "tls-client-ca-file", kMaxCredentialBytes,
                           CredentialKind::kPublic));
  }
  calls.credentials = grpc::SslCredentials(ssl);
  return calls;
}

}  // namespace layercast::server
