#pragma once

#include <string>

#include "absl/status/status.h"
#include "platform/file_system.h"

namespace layercast {

// Whether a file holding a secret (an admin token, a TLS private key) is
// private enough to use. A token or key that other users can read is as good
// as published, and the usual way to get one is a umask of 022 (0644), so
// the shard and the layercast tool refuse it rather than use it quietly.
//
// OK when nobody but the file's owner has any permission on it; also when
// the file belongs to root and grants its group read and nothing more (0640,
// 0440): root handing a file to a service's group is deliberate (PostgreSQL
// accepts its keys so), and it is how Kubernetes mounts a Secret with
// `fsGroup` (root-owned, mode defaultMode | 0440). Otherwise
// FAILED_PRECONDITION naming `--flag`, the path, its mode in octal and the
// `chmod` that fixes it.
absl::Status CheckSecretFilePermissions(const RandomAccessFile& file, const std::string& flag);

}  // namespace layercast
