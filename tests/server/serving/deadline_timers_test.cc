// DeadlineTimers on a thread of their own and on a shared one (the shard's
// one timer thread): callbacks run on the shared thread, and none of an
// owner's runs once its DeadlineTimers is gone, while the others' still do.

#include "server/serving/deadline_timers.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "platform/clock.h"

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace layercast::server {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

TEST(DeadlineTimersTest, OwnersOfASharedThreadRunOnItAndStopWhenTheyGo) {
  DeadlineTimers shard;
  std::thread::id shard_thread;
  {
    absl::Notification ran;
    shard.Post([&] {
      shard_thread = std::this_thread::get_id();
      ran.Notify();
    });
    ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
  }
  std::atomic<int> kept{0}, dropped{0};
  DeadlineTimers staying(&shard);
  absl::Notification stayed;
  staying.Schedule(steady_clock::now() + milliseconds(100), [&] {
    EXPECT_EQ(std::this_thread::get_id(), shard_thread) << "on the shard's one thread";
    ++kept;
    stayed.Notify();
  });
  {
    DeadlineTimers going(&shard);
    going.Schedule(steady_clock::now() + milliseconds(50), [&] { ++dropped; });
    going.Post([&] { absl::SleepFor(absl::Milliseconds(1)); });
  }  // gone before its deadline
  ASSERT_TRUE(stayed.WaitForNotificationWithTimeout(absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(kept.load(), 1);
  EXPECT_EQ(dropped.load(), 0) << "a callback of an owner that is gone never runs";
}

TEST(DeadlineTimersTest, ACancelledTimerNeverRuns) {
  DeadlineTimers own;
  std::atomic<int> runs{0};
  DeadlineTimers::Handle timer =
      own.Schedule(steady_clock::now() + milliseconds(100), [&] { ++runs; });
  own.Cancel(timer);
  EXPECT_EQ(own.Schedule(steady_clock::time_point::max(), [&] { ++runs; }), nullptr);
  absl::SleepFor(absl::Milliseconds(250));
  EXPECT_EQ(runs.load(), 0);
}

// On a ManualClock a deadline is an event the test causes: nothing runs
// while the clock stands, however long; a jump runs everything it passed,
// in deadline order, before Advance returns, including what a callback
// scheduled due at once; a cancelled one never runs.
TEST(DeadlineTimersTest, OnAManualClockCallbacksRunWhenTheClockPassesThem) {
  platform::ManualClock clock;
  DeadlineTimers timers(clock);
  DeadlineTimers sharing(&timers);
  EXPECT_EQ(&sharing.clock(), &clock) << "a shared thread's clock too";
  std::vector<int> ran;  // written on the timer thread, read after Advance
  const auto start = clock.Now();
  timers.Schedule(start + milliseconds(30), [&] { ran.push_back(30); });
  sharing.Schedule(start + milliseconds(10), [&] {
    ran.push_back(10);
    sharing.Schedule(start, [&] { ran.push_back(0); });  // due already
  });
  DeadlineTimers::Handle cancelled =
      timers.Schedule(start + milliseconds(20), [&] { ran.push_back(20); });
  timers.Cancel(cancelled);
  timers.Schedule(start + milliseconds(40), [&] { ran.push_back(40); });

  absl::SleepFor(absl::Milliseconds(60));  // real time passes; the clock does not
  timers.Post([] {});
  clock.Advance(milliseconds(0));
  EXPECT_TRUE(ran.empty());
  clock.Advance(milliseconds(30));
  EXPECT_EQ(ran, (std::vector<int>{10, 0, 30}));
  clock.Advance(milliseconds(9));
  EXPECT_EQ(ran.size(), 3u) << "1 ms before 40";
  clock.Advance(milliseconds(1));
  EXPECT_EQ(ran, (std::vector<int>{10, 0, 30, 40}));
  EXPECT_EQ(timers.Now(), start + milliseconds(40));
}

}  // namespace
}  // namespace layercast::server
