// The one retry rule: Retry stops at the policy's cap, at a code it does
// not retry and before a wait that would pass the deadline; its waits grow
// from the first to the maximum, each drawn from [half, full]; and it waits
// on the clock it is given, so these run in milliseconds on a ManualClock.

#include "platform/retry.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace layercast::platform {
namespace {

using std::chrono::milliseconds;

// The hooks of a loop on `clock` whose waits move it and are written down.
RetryHooks MovingHooks(ManualClock& clock, std::vector<milliseconds>& waits) {
  RetryHooks hooks;
  hooks.clock = &clock;
  hooks.sleep = [&clock, &waits](milliseconds wait) {
    waits.push_back(wait);
    clock.Advance(wait);
    return true;
  };
  return hooks;
}

TEST(RetryTest, StopsAtTheCapWithTheLastStatus) {
  ManualClock clock;
  std::vector<milliseconds> waits;
  const RetryPolicy policy{.retry_on = StatusCodes({absl::StatusCode::kUnavailable}),
                           .max_attempts = 5};
  int calls = 0;
  const absl::Status status = Retry(
      policy, clock.Now() + std::chrono::hours(1),
      [&](int attempt) {
        EXPECT_EQ(attempt, ++calls);
        return absl::UnavailableError("attempt " + std::to_string(attempt));
      },
      MovingHooks(clock, waits));
  EXPECT_EQ(calls, 5);
  EXPECT_EQ(waits.size(), 4u);
  EXPECT_EQ(status, absl::UnavailableError("attempt 5"));
}

TEST(RetryTest, WaitsDoubleFromTheFirstToTheMaximumEachDrawnFromHalfToFull) {
  ManualClock clock;
  std::vector<milliseconds> waits;
  const RetryPolicy policy{.retry_on = kEveryError,
                           .max_attempts = 9,
                           .first_wait = milliseconds(50),
                           .max_wait = milliseconds(2000)};
  (void)Retry(
      policy, clock.Now() + std::chrono::hours(1), [](int) { return absl::AbortedError("again"); },
      MovingHooks(clock, waits));
  const std::vector<int64_t> fulls = {50, 100, 200, 400, 800, 1600, 2000, 2000};
  ASSERT_EQ(waits.size(), fulls.size());
  for (size_t i = 0; i < fulls.size(); ++i) {
    EXPECT_GE(waits[i].count(), fulls[i] / 2) << "wait " << i;
    EXPECT_LE(waits[i].count(), fulls[i]) << "wait " << i;
  }
  Backoff backoff(policy);
  for (int i = 0; i < 5; ++i) (void)backoff.Next();
  backoff.Reset();
  EXPECT_LE(backoff.Next().count(), 50);
}

TEST(RetryTest, StopsAtACodeThePolicyDoesNotRetry) {
  ManualClock clock;
  std::vector<milliseconds> waits;
  int calls = 0;
  const absl::Status status = Retry(
      kConnect, clock.Now() + std::chrono::hours(1),
      [&](int) {
        return ++calls < 3 ? absl::UnavailableError("loading")
                           : absl::FailedPreconditionError("another model");
      },
      MovingHooks(clock, waits));
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(status, absl::FailedPreconditionError("another model"));
  // Success ends it as well, at once.
  calls = 0;
  EXPECT_TRUE(Retry(kConnect, clock.Now() + std::chrono::hours(1), [&](int) {
                ++calls;
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(calls, 1);
}

TEST(RetryTest, GivesUpBeforeAWaitThatWouldPassTheDeadline) {
  ManualClock clock;
  std::vector<milliseconds> waits;
  const Clock::TimePoint deadline = clock.Now() + milliseconds(1000);
  const absl::Status status = Retry(
      kConnect, deadline, [](int) { return absl::UnavailableError("down"); },
      MovingHooks(clock, waits));
  EXPECT_TRUE(absl::IsUnavailable(status));
  ASSERT_FALSE(waits.empty());
  EXPECT_LT(clock.Now(), deadline);  // never waited past it
  // Waits drawn from [25, 50], [50, 100], ... ms: 4 of them fit in 1 s at
  // the most they can be, 5 at the least.
  EXPECT_GE(waits.size(), 4u);
  EXPECT_LE(waits.size(), 5u);
}

TEST(RetryTest, ASleepThatSaysStopEndsTheLoop) {
  ManualClock clock;
  int calls = 0;
  RetryHooks hooks;
  hooks.clock = &clock;
  hooks.sleep = [](milliseconds) { return false; };
  int told = 0;
  hooks.on_retry = [&told](const absl::Status& failed, int attempt, milliseconds) {
    EXPECT_TRUE(absl::IsUnavailable(failed));
    told = attempt;
  };
  EXPECT_TRUE(absl::IsUnavailable(Retry(
      kConnect, clock.Now() + std::chrono::hours(1),
      [&](int) {
        ++calls;
        return absl::UnavailableError("down");
      },
      hooks)));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(told, 1);
}

TEST(RetryTest, WaitsOnAManualClockUntilItIsMoved) {
  ManualClock clock;
  std::atomic<int> calls{0};
  const RetryPolicy policy{.retry_on = kEveryError,
                           .max_attempts = 3,
                           .first_wait = std::chrono::seconds(10),
                           .max_wait = std::chrono::seconds(10)};
  absl::Status status;
  std::thread loop([&] {
    RetryHooks hooks;
    hooks.clock = &clock;
    status = Retry(
        policy, clock.Now() + std::chrono::hours(1),
        [&](int) {
          ++calls;
          return absl::UnavailableError("down");
        },
        hooks);
  });
  // Waits of 5-10 s of the clock's time pass in no real time at all.
  for (int i = 0; i < 2000 && calls.load() < 3; ++i) {
    clock.Advance(std::chrono::seconds(1));
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  loop.join();
  EXPECT_EQ(calls.load(), 3);
  EXPECT_TRUE(absl::IsUnavailable(status));
}

}  // namespace
}  // namespace layercast::platform
