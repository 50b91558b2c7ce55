// The service config that has gRPC retry the read-only unary calls by
// platform::kUnaryCall (its waits are tested in tests/platform/retry_test.cc).

#include "client/grpc_retry_config.h"

#include <gmock/gmock.h>
#include <grpcpp/support/validate_service_config.h>
#include <gtest/gtest.h>

namespace layercast::client {
namespace {

using ::testing::HasSubstr;

TEST(GrpcRetryConfigTest, GRPCTakesTheUnaryRetryPolicy) {
  const std::string config = UnaryRetryServiceConfig();
  EXPECT_EQ(grpc::experimental::ValidateServiceConfigJSON(config), "") << config;
  EXPECT_THAT(config, HasSubstr(R"("maxAttempts":4)"));
  EXPECT_THAT(config, HasSubstr(R"("initialBackoff":"0.05s")"));
  EXPECT_THAT(config, HasSubstr(R"("maxBackoff":"2s")"));
  EXPECT_THAT(config, HasSubstr(R"("method":"GetManifest")"));
  EXPECT_THAT(config, HasSubstr(R"("retryableStatusCodes":["UNAVAILABLE"])"));
}

}  // namespace
}  // namespace layercast::client
