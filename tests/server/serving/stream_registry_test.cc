// StreamRegistry's slots: each kind refused past its flag, with the flag
// named, and given back when its call ends; a connection's WaitVersion
// calls counted apart from another's.

#include "server/serving/stream_registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>

#include "platform/clock.h"
#include "server/serving/deadline_timers.h"

namespace layercast::server {
namespace {

using ::testing::HasSubstr;

StreamRegistry::Limits SmallLimits() {
  return {.max_streams = 2,
          .max_parked_streams = 1,
          .max_push_streams = 1,
          .max_waits_per_connection = 1,
          .write_progress_timeout = std::chrono::milliseconds(200)};
}

TEST(StreamRegistryTest, EachKindOfSlotIsRefusedPastItsFlagAndGivenBack) {
  ServerMetrics metrics;
  StreamRegistry registry(SmallLimits(), metrics, {});
  ASSERT_TRUE(registry.Admit(/*parked=*/false).ok());
  ASSERT_TRUE(registry.Admit(/*parked=*/false).ok());
  const grpc::Status full = registry.Admit(/*parked=*/false);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(full.error_message(), HasSubstr("--max-streams"));
  ASSERT_TRUE(registry.Admit(/*parked=*/true).ok());
  EXPECT_THAT(registry.Admit(/*parked=*/true).error_message(), HasSubstr("--max-parked-streams"));
  EXPECT_EQ(registry.in_flight(), 3);
  EXPECT_EQ(registry.streaming(), 2);

  registry.Leave(/*parked=*/false);
  // A parked stream whose version came streams, past --max-streams if need be.
  registry.Unpark();
  EXPECT_EQ(registry.streaming(), 2);
  EXPECT_TRUE(registry.Admit(/*parked=*/true).ok()) << "the parked slot was given back";
  registry.Leave(/*parked=*/true);
  registry.Leave(/*parked=*/false);
  registry.Leave(/*parked=*/false);
  EXPECT_TRUE(registry.WaitUntilIdle(absl::Now() + absl::Seconds(1)));
}

TEST(StreamRegistryTest, WaitsAreCountedPerConnectionAndHoldAParkedSlot) {
  ServerMetrics metrics;
  StreamRegistry registry(SmallLimits(), metrics, {});
  ASSERT_TRUE(registry.AddWait("ipv4:127.0.0.1:5000").ok());
  const grpc::Status second = registry.AddWait("ipv4:127.0.0.1:5000");
  EXPECT_THAT(second.error_message(), HasSubstr("--max-waits-per-connection"));
  // Another connection has a place of its own, but the one parked slot is taken.
  const grpc::Status other = registry.AddWait("ipv4:127.0.0.1:5001");
  EXPECT_THAT(other.error_message(), HasSubstr("--max-parked-streams"));
  registry.RemoveWait("ipv4:127.0.0.1:5000");
  EXPECT_TRUE(registry.AddWait("ipv4:127.0.0.1:5001").ok()) << "both given back";
  registry.RemoveWait("ipv4:127.0.0.1:5001");
  EXPECT_EQ(registry.in_flight(), 0);
}

TEST(StreamRegistryTest, TheSweepRunsOnItsTimerUntilTheRegistryGoes) {
  ServerMetrics metrics;
  platform::ManualClock clock;
  DeadlineTimers timers(clock);
  std::atomic<int> sweeps{0};
  {
    StreamRegistry registry(
        SmallLimits(), metrics, [&] { ++sweeps; }, &timers);
    // 50 ms a sweep: a quarter of the 200 ms timeout.
    clock.Advance(std::chrono::milliseconds(49));
    EXPECT_EQ(sweeps.load(), 0);
    for (int i = 1; i <= 3; ++i) {
      clock.Advance(std::chrono::milliseconds(i == 1 ? 1 : 50));
      EXPECT_EQ(sweeps.load(), i);
    }
  }
  clock.Advance(std::chrono::milliseconds(500));
  EXPECT_EQ(sweeps.load(), 3) << "no sweep after the registry is destroyed";
}

}  // namespace
}  // namespace layercast::server
