#include "platform/secret_file.h"

#include "absl/strings/str_cat.h"

namespace layercast {
namespace {

// "0644": the way chmod and ls -l users read modes.
std::string Octal(uint32_t mode) {
  std::string digits;
  for (int shift = 9; shift >= 0; shift -= 3) {
    digits += static_cast<char>('0' + ((mode >> shift) & 07));
  }
  return digits;
}

}  // namespace

absl::Status CheckSecretFilePermissions(const RandomAccessFile& file, const std::string& flag) {
  const FilePermissions permissions = file.permissions();
  const uint32_t group = permissions.mode & 070;
  const uint32_t others = permissions.mode & 007;
  const bool root_shares_with_group = permissions.owner_uid == 0 && group == 040;
  if (others == 0 && (group == 0 || root_shares_with_group)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "--", flag, " ", file.path(), " has mode ", Octal(permissions.mode),
      ", which gives users other than its owner access to the secret it holds: run `chmod 600 ",
      file.path(), "` (a file owned by root may also let its group read it: 0640)"));
}

}  // namespace layercast
