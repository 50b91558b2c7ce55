#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "platform/file_system.h"
#include "server/access/auth_token.h"

namespace layercast::server {

// Worker identity for training (--worker-token-dir): one bearer token per
// data-parallel worker index, so that a push or a clip scale for worker k
// needs worker k's token. Without it any peer that reaches the shard can
// push as any worker (docs/security.md says so).
//
// The directory holds a file per worker, `worker-<k>` for k < workers,
// each one token (a Kubernetes Secret with those keys, mounted as a
// volume, is such a directory). Tokens are kept and compared as AdminToken
// keeps its own: by SHA-256, in constant time.
//
// Immutable; thread-safe.
class WorkerTokens {
 public:
  // Reads DIR/worker-0 .. DIR/worker-<workers-1>: each a secret file
  // holding one token (AdminToken::FromFile's checks), no two alike, else
  // INVALID_ARGUMENT naming the file; the file system's code (NOT_FOUND
  // naming the missing worker's file) when one cannot be read.
  static absl::StatusOr<WorkerTokens> FromDir(const std::string& dir, uint32_t workers,
                                              FileSystem& fs = DefaultFileSystem());

  // OK when `authorization` (nullptr: the call has none) is "Bearer <worker
  // `worker`'s token>"; UNAUTHENTICATED without a bearer token;
  // PERMISSION_DENIED for any other, another worker's included. `what`
  // names the call for the message ("a push", "a clip scale").
  absl::Status Check(uint32_t worker, const std::string* authorization,
                     absl::string_view what) const;

  // The worker whose token `authorization` carries, for a call that names
  // its worker only later (a push stream, in its first chunk): checked
  // before the call holds anything. UNAUTHENTICATED without a bearer token;
  // PERMISSION_DENIED when it is no worker's. Every worker's token is
  // compared, whichever matches.
  absl::StatusOr<uint32_t> Identify(const std::string* authorization, absl::string_view what) const;

 private:
  explicit WorkerTokens(std::vector<AdminToken> tokens) : tokens_(std::move(tokens)) {}
  std::vector<AdminToken> tokens_;  // by worker index
};

}  // namespace layercast::server
