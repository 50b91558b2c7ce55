#include "wire/grpc_status.h"

#include <gtest/gtest.h>

namespace layercast::wire {
namespace {

TEST(GrpcStatusTest, EveryCodeCrossesBothWaysWithItsMessage) {
  for (int code = 0; code <= 16; ++code) {
    const absl::Status original(static_cast<absl::StatusCode>(code), "what to do");
    const grpc::Status on_wire = ToGrpcStatus(original);
    EXPECT_EQ(static_cast<int>(on_wire.error_code()), code);
    const absl::Status back = FromGrpcStatus(on_wire, "shard 1 (h:1)");
    EXPECT_EQ(back.code(), original.code());
    if (code != 0) {
      EXPECT_EQ(on_wire.error_message(), "what to do");
      EXPECT_EQ(back.message(), "shard 1 (h:1): what to do");
    }
  }
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::OK), "OK");
}

}  // namespace
}  // namespace layercast::wire
