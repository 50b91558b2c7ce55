#pragma once

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
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

// What a command that called every shard returns: the first error of
// `answers` (each an absl::Status or StatusOr), the others printed to
// stderr; OK when every call was.
template <typename T>
absl::Status FirstError(const std::vector<T>& answers) {
  absl::Status first;
  for (const T& answer : answers) {
    absl::Status status;
    if constexpr (std::is_same_v<T, absl::Status>) {
      status = answer;
    } else {
      status = answer.status();
    }
    if (status.ok()) continue;
    if (first.ok()) {
      first = status;
    } else {
      std::fprintf(stderr, "%s\n", std::string(status.message()).c_str());
    }
  }
  return first;
}

}  // namespace layercast::cli
