#include "server/access/auth_file.h"

#include "absl/strings/str_cat.h"
#include "platform/secret_file.h"
#include "platform/status_macros.h"

namespace layercast::server {

absl::StatusOr<std::string> ReadCredentialFile(const std::string& path, const std::string& flag,
                                               uint64_t max_bytes, CredentialKind kind,
                                               FileSystem& fs) {
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> file = fs.OpenForRead(path);
  if (!file.ok()) {
    return absl::Status(
        file.status().code(),
        absl::StrCat("--", flag, " ", path, " cannot be read: ", file.status().message()));
  }
  // Before reading: a secret others can read is refused, not used.
  if (kind == CredentialKind::kSecret) RETURN_IF_ERROR(CheckSecretFilePermissions(**file, flag));
  const uint64_t size = (*file)->size();
  if (size == 0 || size > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, " is ", size,
                                                   " bytes long; expected 1 to ", max_bytes));
  }
  std::string content(size, '\0');
  absl::Status read = (*file)->ReadAt(
      0, std::span<uint8_t>(reinterpret_cast<uint8_t*>(content.data()), content.size()));
  if (!read.ok()) {
    return absl::Status(read.code(),
                        absl::StrCat("--", flag, " ", path, " cannot be read: ", read.message()));
  }
  return content;
}

}  // namespace layercast::server
