// ReadCredentialFile: a secret (token, private key) that other users may read
// is refused before it is read; a public one (certificate) is not.

#include "server/access/auth_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/access/auth_token.h"
#include "server/access/worker_tokens.h"
#include "tests/fuzz/memory_file_system.h"

namespace layercast::server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

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

// Worker identity: worker k's push needs worker k's token, read from
// DIR/worker-k; a directory that cannot tell workers apart is refused.
TEST(WorkerTokensTest, EachWorkerPushesOnlyUnderItsOwnToken) {
  fuzz::MemoryFileSystem fs;
  fs.Add("/workers/worker-0", "worker-zero-token-0123456789\n", kOwnerOnly);
  fs.Add("/workers/worker-1", "worker-one-token-0123456789", kOwnerOnly);
  absl::StatusOr<WorkerTokens> tokens = WorkerTokens::FromDir("/workers", 2, fs);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  const std::string zero = "Bearer worker-zero-token-0123456789";
  const std::string one = "bearer worker-one-token-0123456789";
  EXPECT_TRUE(tokens->Check(0, &zero, "a push").ok());
  EXPECT_TRUE(tokens->Check(1, &one, "a push").ok());
  const absl::Status as_other = tokens->Check(0, &one, "a push");
  EXPECT_EQ(as_other.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(as_other.message()),
              AllOf(HasSubstr("a push for worker 0"), HasSubstr("worker-0")));
  EXPECT_THAT(std::string(as_other.message()), Not(HasSubstr("worker-one-token")));
  EXPECT_EQ(tokens->Check(1, nullptr, "a push").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(tokens->Check(2, &one, "a push").code(), absl::StatusCode::kPermissionDenied);

  const absl::Status missing = WorkerTokens::FromDir("/workers", 3, fs).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.message()), HasSubstr("has no file worker-2"));
  fs.Add("/same/worker-0", "the-same-token-0123456789", kOwnerOnly);
  fs.Add("/same/worker-1", " the-same-token-0123456789\n", kOwnerOnly);
  const absl::Status same = WorkerTokens::FromDir("/same", 2, fs).status();
  EXPECT_EQ(same.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(same.message()), HasSubstr("worker-0 and worker-1 hold the same token"));
  fs.Add("/loose/worker-0", "loose-worker-token-0123456789", kEveryoneReads);
  EXPECT_EQ(WorkerTokens::FromDir("/loose", 1, fs).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace layercast::server
