#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "tools/cli_flags.h"

namespace layercast::cli {

// One shard a command calls ShardAdmin on.
struct AdminTarget {
  std::string describe;  // "shard i (host:port)"
  std::string address;   // "host:port"
  std::shared_ptr<grpc::Channel> channel;
};

// What every admin command shares: the shards (SHARDS, TLS flags), the
// admin token (--token-file, plaintext only with --insecure) and how long
// to wait for a connection (--connect-timeout-ms).
struct AdminCalls {
  std::vector<AdminTarget> targets;
  std::string token;
  std::chrono::milliseconds connect_timeout{0};
};
absl::StatusOr<AdminCalls> AdminCallsFromFlags(const tools::CliFlags& flags);

// OK once `target` accepts a connection; else UNAVAILABLE saying why
// (nothing listens, no such host, TLS), found by `probe`, one call made
// with no wait.
absl::Status Connect(const AdminTarget& target, std::chrono::milliseconds timeout,
                     const std::function<grpc::Status(grpc::ClientContext&)>& probe);

// A context carrying the admin token, with `timeout`.
std::unique_ptr<grpc::ClientContext> AdminContext(const std::string& token,
                                                  std::chrono::milliseconds timeout);

}  // namespace layercast::cli
