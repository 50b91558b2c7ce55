#include "client/retry_backoff.h"

#include "absl/strings/str_cat.h"

namespace layercast::client {

std::string UnaryRetryServiceConfig() {
  std::string names;
  for (const char* method : {"GetManifest", "WaitVersion", "GetCastError", "GetGradientNorm"}) {
    absl::StrAppend(&names, names.empty() ? "" : ",",
                    R"({"service":"layercast.v1.ShardService","method":")", method, R"("})");
  }
  const auto seconds = [](std::chrono::milliseconds wait) {
    return absl::StrCat(static_cast<double>(wait.count()) / 1000, "s");
  };
  return absl::StrCat(R"({"methodConfig":[{"name":[)", names, R"(],"retryPolicy":{)",
                      R"("maxAttempts":4,"initialBackoff":")", seconds(RetryBackoff::kFirst),
                      R"(","maxBackoff":")", seconds(RetryBackoff::kCap),
                      R"(","backoffMultiplier":2,"retryableStatusCodes":["UNAVAILABLE"]}}]})");
}

}  // namespace layercast::client
