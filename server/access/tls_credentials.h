#pragma once

#include <memory>
#include <string>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"
#include "layercast/v1/config.pb.h"
#include "platform/file_system.h"

namespace layercast::server {

// How a shard server's gRPC port is secured, from its config.
struct ServerSecurity {
  std::shared_ptr<grpc::ServerCredentials> credentials;
  bool tls = false;     // tls_cert_file and tls_key_file are set
  bool mutual = false;  // and tls_client_ca_file: client certificates required
};

// Plaintext without tls_cert_file; TLS with tls_cert_file and tls_key_file;
// mutual TLS (client certificates required and verified against
// tls_client_ca_file) with all three. Every file is read (through `fs`) and
// parsed here with OpenSSL, and the key is checked against the certificate,
// so a bad file stops the server at start with its name rather than failing
// the bind. INVALID_ARGUMENT naming the flag and the problem.
absl::StatusOr<ServerSecurity> ServerSecurityFor(const layercast::v1::ShardConfig& config,
                                                 FileSystem& fs = DefaultFileSystem());

}  // namespace layercast::server
