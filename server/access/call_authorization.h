#pragma once

#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>

namespace layercast::server {

// The call's "authorization" metadata value; nullopt when it has none. What
// AdminToken::Check and WorkerTokens::Check take (as a pointer, null for
// none).
inline std::optional<std::string> AuthorizationOf(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  const auto entry = metadata.find("authorization");
  if (entry == metadata.end()) return std::nullopt;
  return std::string(entry->second.data(), entry->second.size());
}

}  // namespace layercast::server
