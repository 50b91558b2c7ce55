#include "client/grpc_retry_config.h"

#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "platform/retry.h"

namespace layercast::client {

std::string UnaryRetryServiceConfig() {
  const platform::RetryPolicy& policy = platform::kUnaryCall;
  std::string names;
  for (const char* method : {"GetManifest", "WaitVersion", "GetCastError", "GetGradientNorm"}) {
    absl::StrAppend(&names, names.empty() ? "" : ",",
                    R"({"service":"layercast.v1.ShardService","method":")", method, R"("})");
  }
  std::string codes;
  for (int code = 1; code <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++code) {
    const absl::Status status(static_cast<absl::StatusCode>(code), "");
    if (!policy.Retries(status)) continue;
    absl::StrAppend(&codes, codes.empty() ? "" : ",", "\"", absl::StatusCodeToString(status.code()),
                    "\"");
  }
  const auto seconds = [](std::chrono::milliseconds wait) {
    return absl::StrCat(static_cast<double>(wait.count()) / 1000, "s");
  };
  return absl::StrCat(R"({"methodConfig":[{"name":[)", names, R"(],"retryPolicy":{)",
                      R"("maxAttempts":)", policy.max_attempts, R"(,"initialBackoff":")",
                      seconds(policy.first_wait), R"(","maxBackoff":")", seconds(policy.max_wait),
                      R"(","backoffMultiplier":2,"retryableStatusCodes":[)", codes, "]}}]}");
}

}  // namespace layercast::client
