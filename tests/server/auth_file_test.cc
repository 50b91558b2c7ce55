// ReadCredentialFile: a secret (token, private key) that other users may read
// is refused before it is read; a public one (certificate) is not.

#include "server/auth_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/auth_token.h"
#include "tests/fuzz/memory_file_system.h"

namespace layercast::server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kToken[] = "auth-file-test-token-0123456789abcdef";
constexpr FilePermissions kOwnerOnly = {.mode = 0600, .owner_uid = 10001};
constexpr FilePermissions kEveryoneReads = {.mode = 0644, .owner_uid = 10001};

TEST(ReadCredentialFileTest, ASecretOthersMayReadIsRefused) {
  fuzz::MemoryFileSystem fs;
  fs.Add("/loose/token", kToken, kEveryoneReads);
  absl::StatusOr<std::string> content =
      ReadCredentialFile("/loose/token", "admin-token-file", 4096, CredentialKind::kSecret, fs);
  EXPECT_EQ(content.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(content.status().message()),
              AllOf(HasSubstr("--admin-token-file /loose/token has mode 0644"),
                    HasSubstr("chmod 600 /loose/token")));

  absl::StatusOr<AdminToken> token = AdminToken::FromFile("/loose/token", fs);
  EXPECT_EQ(token.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ReadCredentialFileTest, APrivateSecretAndAPublicCertificateAreRead) {
  fuzz::MemoryFileSystem fs;
  fs.Add("/private/token", kToken, kOwnerOnly);
  fs.Add("/public/cert.pem", "-----BEGIN CERTIFICATE-----", kEveryoneReads);
  absl::StatusOr<std::string> token =
      ReadCredentialFile("/private/token", "admin-token-file", 4096, CredentialKind::kSecret, fs);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, kToken);
  EXPECT_TRUE(AdminToken::FromFile("/private/token", fs).ok());
  absl::StatusOr<std::string> cert =
      ReadCredentialFile("/public/cert.pem", "tls-cert-file", 4096, CredentialKind::kPublic, fs);
  EXPECT_TRUE(cert.ok()) << cert.status();
}

}  // namespace
}  // namespace layercast::server
