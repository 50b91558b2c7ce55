#pragma once

#include <memory>
#include <string>

#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "layercast/v1/config.pb.h"

namespace layercast::server {

// How a shard calls other shards' ShardAdmin (its --peers, or the old set
// of a hand-over): with its own admin token, over TLS when it serves TLS
// (its certificate as client certificate, --peer-tls-ca-file, else
// --tls-client-ca-file, to trust), in clear text only with --peers-insecure.
struct PeerCalls {
  std::string token;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};
// `flag` names the flag that needs the peers, for messages.
// INVALID_ARGUMENT for a token that would go in clear text without
// --peers-insecure; the credential files' errors otherwise.
absl::StatusOr<PeerCalls> PeerCallsFromConfig(const layercast::v1::ShardConfig& config,
                                              absl::string_view flag);

}  // namespace layercast::server
