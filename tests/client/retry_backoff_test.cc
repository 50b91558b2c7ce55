// The worker library's one retry rule: RetryBackoff's waits, and the
// service config that has gRPC retry the read-only unary calls with the
// same first wait and cap.

#include "client/retry_backoff.h"

#include <gmock/gmock.h>
#include <grpcpp/support/validate_service_config.h>
#include <gtest/gtest.h>

namespace layercast::client {
namespace {

using ::testing::HasSubstr;

TEST(RetryBackoffTest, WaitsDoubleFromTheFirstToTheCapEachDrawnFromHalfToFull) {
  RetryBackoff backoff;
  for (int64_t full : {50, 100, 200, 400, 800, 1600, 2000, 2000}) {
    const int64_t wait = backoff.Next().count();
    EXPECT_GE(wait, full / 2);
    EXPECT_LE(wait, full);
  }
  backoff.Reset();
  EXPECT_LE(backoff.Next().count(), 50);
}

TEST(RetryBackoffTest, GRPCTakesTheUnaryRetryPolicy) {
  const std::string config = UnaryRetryServiceConfig();
  EXPECT_EQ(grpc::experimental::ValidateServiceConfigJSON(config), "") << config;
  EXPECT_THAT(config, HasSubstr(R"("initialBackoff":"0.05s")"));
  EXPECT_THAT(config, HasSubstr(R"("maxBackoff":"2s")"));
  EXPECT_THAT(config, HasSubstr(R"("method":"GetManifest")"));
  EXPECT_THAT(config, HasSubstr(R"("retryableStatusCodes":["UNAVAILABLE"])"));
}

}  // namespace
}  // namespace layercast::client
