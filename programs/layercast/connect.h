#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "client/shard_set.h"
#include "tools/cli_flags.h"

namespace layercast::cli {

// The flags every command that talks to a shard set takes: where the shards
// are, and how to reach them (TLS, see ChannelCredentialsFromFlags).
inline const std::set<std::string> kShardSetFlags = {
    "shards",      "shards-pattern", "num-shards",  "connect-timeout-ms",
    "tls-ca-file", "tls-cert-file",  "tls-key-file"};

// kShardSetFlags plus a command's own.
std::set<std::string> WithShardSetFlags(std::set<std::string> own);

// A deadline flag in milliseconds (--timeout-ms, --connect-timeout-ms):
// `fallback_ms` when absent; INVALID_ARGUMENT for 0, which would fail every
// call at once as a bare "Deadline Exceeded", and for a value that is not
// an unsigned integer.
absl::StatusOr<std::chrono::milliseconds> TimeoutFromFlags(const tools::CliFlags& flags,
                                                           const std::string& name,
                                                           uint64_t fallback_ms);

// Addresses from --shards A,B,... or --shards-pattern P --num-shards N.
absl::StatusOr<std::vector<std::string>> ShardAddressesFromFlags(const tools::CliFlags& flags);

// Channel credentials from the TLS flags: plaintext (null) without any;
// TLS verifying the shards' certificates against --tls-ca-file (PEM; the
// system's roots when absent) when any is given; mutual TLS, presenting
// --tls-cert-file with its --tls-key-file (both or neither), for shards that
// require client certificates. INVALID_ARGUMENT naming the flag when a file
// is unreadable or a half pair is given; FAILED_PRECONDITION when other users
// may read --tls-key-file (CheckSecretFilePermissions).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFlags(
    const tools::CliFlags& flags);

// Connects to the shard set named by the flags above (and waits up to
// --connect-timeout-ms for it to be ready).
absl::StatusOr<std::unique_ptr<client::ShardSet>> ConnectFromFlags(const tools::CliFlags& flags);

}  // namespace layercast::cli
