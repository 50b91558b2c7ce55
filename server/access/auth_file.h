#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "platform/file_system.h"

namespace layercast::server {

// What a credential file holds: something anyone may see (a certificate), or
// a secret (a token, a private key) that must be its owner's alone.
enum class CredentialKind { kPublic, kSecret };

// Reads a small credential file (a token, a PEM certificate or key) whole,
// through `fs`. `flag` names the setting the path came from, for messages:
// INVALID_ARGUMENT when the file is empty or over `max_bytes`;
// FAILED_PRECONDITION for a kSecret that other users may read
// (CheckSecretFilePermissions); the file system's code (NOT_FOUND,
// PERMISSION_DENIED, ...) when it cannot be read.
absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, const std::string& flag,
                                               uint64_t max_bytes, CredentialKind kind,
                                               FileSystem& fs = DefaultFileSystem());

}  // namespace layercast::server
