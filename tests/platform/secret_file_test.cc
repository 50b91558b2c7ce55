// Which files may hold a secret: only their owner's, or root's shared with
// its group for reading; anything else is refused with a message that names
// the file, its mode and the chmod that fixes it.

#include "platform/secret_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace layercast {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint32_t kRoot = 0;
constexpr uint32_t kUser = 10001;

// A file that only has a path and permissions.
class StatOnlyFile final : public RandomAccessFile {
 public:
  StatOnlyFile(uint32_t mode, uint32_t owner_uid)
      : permissions_{.mode = mode, .owner_uid = owner_uid} {}
  uint64_t size() const override { return 0; }
  absl::Status ReadAt(uint64_t, std::span<uint8_t>) const override {
    return absl::UnimplementedError("not read");
  }
  const std::string& path() const override { return path_; }
  FilePermissions permissions() const override { return permissions_; }

 private:
  const std::string path_ = "/etc/layercast/admin.token";
  const FilePermissions permissions_;
};

absl::Status Check(uint32_t mode, uint32_t owner_uid) {
  return CheckSecretFilePermissions(StatOnlyFile(mode, owner_uid), "admin-token-file");
}

TEST(SecretFileTest, TheOwnersAloneIsAccepted) {
  for (const uint32_t owner : {kRoot, kUser}) {
    for (const uint32_t mode : {0600u, 0400u, 0200u, 0700u, 0000u}) {
      EXPECT_TRUE(Check(mode, owner).ok()) << std::oct << mode << " owned by " << std::dec << owner;
    }
  }
}

TEST(SecretFileTest, ReadableByOthersOrTheGroupIsRefusedNamingTheFileTheModeAndTheFix) {
  const absl::Status status = Check(0644, kUser);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("--admin-token-file /etc/layercast/admin.token has mode 0644"),
                    HasSubstr("chmod 600 /etc/layercast/admin.token")));
  for (const uint32_t mode : {0640u, 0604u, 0620u, 0602u, 0610u, 0601u, 0660u, 0666u, 0777u}) {
    EXPECT_EQ(Check(mode, kUser).code(), absl::StatusCode::kFailedPrecondition) << std::oct << mode;
  }
}

TEST(SecretFileTest, RootMayShareAFileWithItsGroupForReadingOnly) {
  // How Kubernetes mounts a Secret with fsGroup: root-owned, 0400 | 0440.
  EXPECT_TRUE(Check(0440, kRoot).ok());
  EXPECT_TRUE(Check(0640, kRoot).ok());
  for (const uint32_t mode : {0660u, 0650u, 0444u, 0644u, 0604u, 0441u}) {
    EXPECT_EQ(Check(mode, kRoot).code(), absl::StatusCode::kFailedPrecondition) << std::oct << mode;
  }
}

}  // namespace
}  // namespace layercast
