// PeriodicCheckpoints on the shard's background thread: a write at each
// multiple the version gate reaches, on that thread and no other, and the
// one stop rule: going waits for the write under way, and none starts after.

#include "server/training/periodic_checkpoints.h"

#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio/thread_pool.hpp>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace layercast::server {
namespace {

// The versions written, and the thread each write ran on.
struct Writes {
  absl::Mutex mu;
  std::vector<uint64_t> versions ABSL_GUARDED_BY(mu);
  std::vector<std::thread::id> threads ABSL_GUARDED_BY(mu);
  size_t want ABSL_GUARDED_BY(mu) = 0;

  // Waits up to 5 s for `count` writes.
  bool AwaitCount(size_t count) {
    absl::MutexLock lock(&mu);
    want = count;
    return mu.AwaitWithTimeout(absl::Condition(&Enough, this), absl::Seconds(5));
  }
  static bool Enough(Writes* writes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(writes->mu) {
    return writes->versions.size() >= writes->want;
  }
};

class PeriodicCheckpointsTest : public ::testing::Test {
 protected:
  boost::asio::thread_pool grants_{1};
  DeadlineTimers timers_;
  DeadlineTimers background_;
  VersionGate gate_{grants_.get_executor(), 0, &timers_};
};

TEST_F(PeriodicCheckpointsTest, WritesAtEachMultipleOnTheBackgroundThread) {
  std::thread::id background_thread;
  absl::Notification known;
  background_.Post([&] {
    background_thread = std::this_thread::get_id();
    known.Notify();
  });
  ASSERT_TRUE(known.WaitForNotificationWithTimeout(absl::Seconds(5)));

  Writes writes;
  PeriodicCheckpoints periodic(
      gate_, 2,
      [&]() -> absl::StatusOr<CheckpointInfo> {
        absl::MutexLock lock(&writes.mu);
        writes.versions.push_back(gate_.version());
        writes.threads.push_back(std::this_thread::get_id());
        CheckpointInfo info;
        info.version = gate_.version();
        return info;
      },
      &background_);
  gate_.Advance(1);
  gate_.Advance(2);
  ASSERT_TRUE(writes.AwaitCount(1));
  gate_.Advance(5);  // past 4: one write, at 5, and the next multiple is 6
  ASSERT_TRUE(writes.AwaitCount(2));
  gate_.Advance(6);
  ASSERT_TRUE(writes.AwaitCount(3));
  absl::SleepFor(absl::Milliseconds(50));
  absl::MutexLock lock(&writes.mu);
  EXPECT_EQ(writes.versions, (std::vector<uint64_t>{2, 5, 6}));
  for (const std::thread::id thread : writes.threads) {
    EXPECT_EQ(thread, background_thread) << "every write on the shard's background thread";
  }
}

TEST_F(PeriodicCheckpointsTest, GoingWaitsForTheWriteUnderWayAndStartsNoneAfter) {
  absl::Notification writing, release;
  std::atomic<int> writes{0};
  auto periodic = std::make_unique<PeriodicCheckpoints>(
      gate_, 1,
      [&]() -> absl::StatusOr<CheckpointInfo> {
        ++writes;
        writing.Notify();
        release.WaitForNotificationWithTimeout(absl::Seconds(5));
        return absl::UnavailableError("the disk is gone: the next multiple tries again");
      },
      &background_);
  gate_.Advance(1);
  ASSERT_TRUE(writing.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_TRUE(periodic->writing()) << "ShardAdmin.Checkpoint's ABORTED reads it meanwhile";

  std::atomic<bool> gone{false};
  std::thread stopper([&] {
    periodic.reset();
    gone = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(gone.load()) << "stopping waits for the write under way";
  release.Notify();
  stopper.join();
  EXPECT_TRUE(gone.load());

  gate_.Advance(3);  // multiples passed once it is gone
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(writes.load(), 1) << "no write starts once it is gone";
}

}  // namespace
}  // namespace layercast::server
