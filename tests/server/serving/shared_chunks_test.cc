// SharedChunks on its own, without gRPC calls: each chunk is cast once however
// many streams ask for it, kept chunks are charged to the memory budget and
// given up first when a stream waits for budget, and failures are never kept.

#include "server/serving/shared_chunks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <boost/asio/thread_pool.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "platform/clock.h"
#include "server/serving/deadline_timers.h"

namespace layercast::server {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr uint64_t kMaster = 1000;
constexpr uint64_t kChunk = 100;

ChunkKey Key(uint64_t begin) {
  return ChunkKey{.layer = 1,
                  .tensor = 2,
                  .element_begin = begin,
                  .elements = kChunk / 2,
                  .version = 0,
                  .dtype = DType::kBFloat16};
}

// A cast that fills kChunk bytes with `fill` and counts its calls.
absl::StatusOr<CastChunk> FakeCast(std::atomic<int>& casts, uint8_t fill,
                                   milliseconds takes = milliseconds(0)) {
  ++casts;
  std::this_thread::sleep_for(takes);
  void* data = std::malloc(kChunk);
  std::memset(data, fill, kChunk);
  return CastChunk{grpc::Slice(data, kChunk, std::free), fill};
}

// GetOrCast as a stream sees it: the chunk now, or once the stream casting
// it resumes this one (waited for here, in the test).
absl::StatusOr<CastChunk> Get(SharedChunks& shared, const ChunkKey& key, uint64_t bytes,
                              SharedChunks::Cast cast) {
  auto resumed = std::make_shared<std::promise<absl::StatusOr<CastChunk>>>();
  std::future<absl::StatusOr<CastChunk>> later = resumed->get_future();
  std::optional<absl::StatusOr<CastChunk>> now = shared.GetOrCast(
      key, bytes, cast,
      [resumed](absl::StatusOr<CastChunk> chunk) { resumed->set_value(std::move(chunk)); });
  if (now) return *std::move(now);
  return later.get();
}

struct Fixture {
  explicit Fixture(uint64_t capacity, std::optional<uint64_t> budget_bytes = std::nullopt,
                   std::chrono::steady_clock::duration max_idle = seconds(60))
      : budget(budget_bytes, kMaster, grants.get_executor()),
        shared(std::make_shared<SharedChunks>(capacity, max_idle, budget, metrics,
                                              grants.get_executor(), &timers)) {
    // Two streams have the layer open: chunks are worth keeping.
    shared->BeginStream(Key(0).layer);
    shared->BeginStream(Key(0).layer);
  }
  // Moves the cache's clock on; returns once the sweeps now due ran.
  void Advance(std::chrono::nanoseconds by) { clock.Advance(by); }

  boost::asio::thread_pool grants{1};
  platform::ManualClock clock;
  DeadlineTimers timers{clock};
  ServerMetrics metrics;
  MemoryBudget budget;
  // Shared, as ShardServer holds it: the budget's reclaimer may still run
  // on the budget's thread while the test ends.
  std::shared_ptr<SharedChunks> shared;
  std::atomic<int> casts{0};
};

TEST(SharedChunksTest, ASecondStreamSendsTheSameBytesWithoutCasting) {
  Fixture f(10 * kChunk);
  auto first = Get(*f.shared, Key(0), kChunk, [&] { return FakeCast(f.casts, 7); });
  auto second = Get(*f.shared, Key(0), kChunk, [&] { return FakeCast(f.casts, 9); });
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(f.casts.load(), 1);
  EXPECT_EQ(first->data.begin(), second->data.begin()) << "one buffer, referenced twice";
  EXPECT_EQ(second->crc32c, 7u);
  EXPECT_EQ(f.metrics.chunks_shared().Value(), 1);

  // Another range, version or dtype is another chunk.
  ChunkKey other_version = Key(0);
  other_version.version = 1;
  ASSERT_TRUE(Get(*f.shared, other_version, kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  ASSERT_TRUE(Get(*f.shared, Key(50), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  EXPECT_EQ(f.casts.load(), 3);
}

TEST(SharedChunksTest, ChunksAreKeptOnlyWhileAnotherStreamOfTheLayerIsOpen) {
  Fixture f(10 * kChunk, kMaster + 10 * kChunk);
  const uint32_t layer = Key(0).layer;
  const auto cast_twice = [&](const ChunkKey& key) {
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(Get(*f.shared, key, kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
    }
  };
  // Two streams of the layer: the first cast is kept, the second read shares it.
  cast_twice(Key(0));
  EXPECT_EQ(f.casts.load(), 1);
  EXPECT_EQ(f.shared->kept_bytes(), kChunk);

  // One stream left: what was kept stays for it (it may be behind), but
  // nothing new is kept for a lone stream.
  f.shared->EndStream(layer);
  EXPECT_EQ(f.shared->kept_bytes(), kChunk);
  cast_twice(Key(0));
  EXPECT_EQ(f.casts.load(), 1);
  cast_twice(Key(50));
  EXPECT_EQ(f.casts.load(), 3);
  EXPECT_EQ(f.shared->kept_bytes(), kChunk);

  // The layer's last stream ends: its chunks go, and their budget.
  f.shared->EndStream(layer);
  EXPECT_EQ(f.shared->kept_bytes(), 0u);
  EXPECT_EQ(f.budget.in_use(), kMaster);

  // A reader that reconnects (a new stream, alone): nothing kept for it,
  // however recently the last stream ended.
  f.shared->BeginStream(layer);
  cast_twice(Key(0));
  EXPECT_EQ(f.casts.load(), 5);
  EXPECT_EQ(f.shared->kept_bytes(), 0u);

  // A layer that shares the lone stream's slot sends it down the locked
  // path, which still keeps nothing: the layers are counted apart.
  const uint32_t same_slot = layer + 1024;
  f.shared->BeginStream(same_slot);
  cast_twice(Key(0));
  EXPECT_EQ(f.casts.load(), 7);
  EXPECT_EQ(f.shared->kept_bytes(), 0u);
  f.shared->EndStream(same_slot);
  f.shared->EndStream(layer);
  EXPECT_EQ(f.budget.in_use(), kMaster);
}

TEST(SharedChunksTest, StreamsAskingWhileAChunkIsCastWaitForThatCast) {
  Fixture f(10 * kChunk);
  constexpr int kStreams = 8;
  std::vector<std::future<absl::StatusOr<CastChunk>>> results;
  for (int i = 0; i < kStreams; ++i) {
    results.push_back(std::async(std::launch::async, [&] {
      return Get(*f.shared, Key(0), kChunk,
                 [&] { return FakeCast(f.casts, 3, milliseconds(100)); });
    }));
  }
  const uint8_t* data = nullptr;
  for (auto& result : results) {
    absl::StatusOr<CastChunk> chunk = result.get();
    ASSERT_TRUE(chunk.ok()) << chunk.status();
    if (data == nullptr) data = chunk->data.begin();
    EXPECT_EQ(chunk->data.begin(), data);
  }
  EXPECT_EQ(f.casts.load(), 1);
  EXPECT_EQ(f.metrics.chunks_shared().Value(), kStreams - 1);
}

TEST(SharedChunksTest, KeptChunksAreChargedToTheBudgetAndGivenBack) {
  Fixture f(10 * kChunk, kMaster + 10 * kChunk);
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(Get(*f.shared, Key(i * 50), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  }
  EXPECT_EQ(f.shared->kept_bytes(), 3 * kChunk);
  EXPECT_EQ(f.budget.in_use(), kMaster + 3 * kChunk);
  EXPECT_EQ(f.metrics.shared_chunk_bytes().Value(), 3 * kChunk);
  f.shared->DropAll();
  EXPECT_EQ(f.shared->kept_bytes(), 0u);
  EXPECT_EQ(f.budget.in_use(), kMaster);
}

TEST(SharedChunksTest, TheOldestChunkMakesRoomAndOnlyWithinCapacity) {
  Fixture f(2 * kChunk);
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(Get(*f.shared, Key(i * 50), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
    f.Advance(milliseconds(1));  // distinct last use
  }
  EXPECT_EQ(f.shared->kept_bytes(), 2 * kChunk);
  ASSERT_TRUE(Get(*f.shared, Key(100), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  EXPECT_EQ(f.casts.load(), 3) << "the newest chunk was kept";
  ASSERT_TRUE(Get(*f.shared, Key(0), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  EXPECT_EQ(f.casts.load(), 4) << "the oldest chunk was dropped for the third";

  // A chunk larger than the capacity is cast for its stream alone.
  ASSERT_TRUE(Get(*f.shared, Key(500), 3 * kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  EXPECT_EQ(f.shared->kept_bytes(), 2 * kChunk);
}

TEST(SharedChunksTest, ChunksUnusedForMaxIdleAreDropped) {
  Fixture f(10 * kChunk, kMaster + 10 * kChunk, milliseconds(40));
  ASSERT_TRUE(Get(*f.shared, Key(0), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  f.Advance(milliseconds(30));
  ASSERT_TRUE(  // a use keeps it
      Get(*f.shared, Key(0), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  f.Advance(milliseconds(30));
  ASSERT_TRUE(Get(*f.shared, Key(50), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  EXPECT_EQ(f.casts.load(), 2);
  EXPECT_EQ(f.shared->kept_bytes(), 2 * kChunk);

  // Nobody asks again: the sweep (every 20 ms) drops each once it is idle
  // for more than 40 ms.
  f.Advance(milliseconds(20));  // at 80: the first idle 50
  EXPECT_EQ(f.shared->kept_bytes(), kChunk);
  f.Advance(milliseconds(20));  // at 100: the second idle 40, not more
  EXPECT_EQ(f.shared->kept_bytes(), kChunk);
  f.Advance(milliseconds(20));
  EXPECT_EQ(f.shared->kept_bytes(), 0u);
  EXPECT_EQ(f.budget.in_use(), kMaster);
}

TEST(SharedChunksTest, SharingNeverTakesBudgetAStreamIsWaitingFor) {
  Fixture f(10 * kChunk, kMaster + 4 * kChunk);
  f.budget.SetReclaimer([weak = std::weak_ptr<SharedChunks>(f.shared)] {
    if (auto shared = weak.lock()) shared->DropAll();
  });
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(Get(*f.shared, Key(i * 50), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  }
  ASSERT_EQ(f.budget.in_use(), kMaster + 3 * kChunk);

  // A stream needs two chunks' worth: it must wait, and the kept chunks go.
  std::promise<bool> granted;
  f.budget.Acquire(2 * kChunk, std::chrono::steady_clock::now() + seconds(10),
                   [&](bool ok) { granted.set_value(ok); });
  auto future = granted.get_future();
  ASSERT_EQ(future.wait_for(seconds(10)), std::future_status::ready);
  EXPECT_TRUE(future.get());
  EXPECT_EQ(f.shared->kept_bytes(), 0u);
  EXPECT_EQ(f.budget.in_use(), kMaster + 2 * kChunk);

  // While someone waits, nothing new is kept; the cast still happens.
  f.budget.Acquire(4 * kChunk, std::chrono::steady_clock::now() + seconds(10), [](bool) {});
  ASSERT_EQ(f.budget.waiting(), 1u);
  ASSERT_TRUE(Get(*f.shared, Key(0), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  EXPECT_EQ(f.shared->kept_bytes(), 0u);
  EXPECT_LE(f.budget.peak(), kMaster + 4 * kChunk);
  f.budget.Release(2 * kChunk);  // lets the waiter through before teardown
}

TEST(SharedChunksTest, AStreamWaitingForAnotherStreamsCastIsResumedNotBlocked) {
  Fixture f(10 * kChunk);
  std::promise<void> casting;
  std::promise<void> finish_cast;
  auto caster = std::async(std::launch::async, [&] {
    return Get(*f.shared, Key(0), kChunk, [&] {
      casting.set_value();
      finish_cast.get_future().wait();
      return FakeCast(f.casts, 5);
    });
  });
  casting.get_future().wait();
  std::promise<absl::StatusOr<CastChunk>> resumed;
  // Returns at once, on this thread, while the other cast is still running.
  std::optional<absl::StatusOr<CastChunk>> now = f.shared->GetOrCast(
      Key(0), kChunk, [&] { return FakeCast(f.casts, 9); },
      [&](absl::StatusOr<CastChunk> chunk) { resumed.set_value(chunk); });
  EXPECT_FALSE(now.has_value());
  auto later = resumed.get_future();
  EXPECT_EQ(later.wait_for(milliseconds(100)), std::future_status::timeout);
  finish_cast.set_value();
  ASSERT_EQ(later.wait_for(seconds(10)), std::future_status::ready);
  absl::StatusOr<CastChunk> chunk = later.get();
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  EXPECT_EQ(chunk->data.begin()[0], 5);
  EXPECT_EQ(chunk->data.begin(), caster.get()->data.begin());
  EXPECT_EQ(f.casts.load(), 1);
}

TEST(SharedChunksTest, DroppingALayerCastsItsChunksAfresh) {
  Fixture f(10 * kChunk, kMaster + 10 * kChunk);
  ASSERT_TRUE(Get(*f.shared, Key(0), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  ChunkKey other_layer = Key(0);
  other_layer.layer = 7;
  f.shared->BeginStream(7);
  f.shared->BeginStream(7);
  ASSERT_TRUE(Get(*f.shared, other_layer, kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  ASSERT_EQ(f.shared->kept_bytes(), 2 * kChunk);
  f.shared->DropLayer(Key(0).layer);
  EXPECT_EQ(f.shared->kept_bytes(), kChunk) << "only that layer's chunks go";
  EXPECT_EQ(f.budget.in_use(), kMaster + kChunk);
  ASSERT_TRUE(Get(*f.shared, Key(0), kChunk, [&] { return FakeCast(f.casts, 2); }).ok());
  EXPECT_EQ(f.casts.load(), 3) << "cast again, not resent";
}

TEST(SharedChunksTest, AFailedCastReachesEveryWaiterAndIsNotKept) {
  Fixture f(10 * kChunk, kMaster + 10 * kChunk);
  std::promise<void> casting;
  std::promise<void> finish_cast;
  const auto fail = [&]() -> absl::StatusOr<CastChunk> {
    ++f.casts;
    casting.set_value();
    finish_cast.get_future().wait();
    return absl::OutOfRangeError("value 1e6 overflows float16");
  };
  auto caster =
      std::async(std::launch::async, [&] { return Get(*f.shared, Key(0), kChunk, fail); });
  casting.get_future().wait();
  // Arrives during the cast: waits for it.
  std::promise<absl::StatusOr<CastChunk>> resumed;
  std::optional<absl::StatusOr<CastChunk>> now = f.shared->GetOrCast(
      Key(0), kChunk, fail, [&](absl::StatusOr<CastChunk> chunk) { resumed.set_value(chunk); });
  ASSERT_FALSE(now.has_value());
  finish_cast.set_value();
  absl::StatusOr<CastChunk> first = caster.get();
  absl::StatusOr<CastChunk> second = resumed.get_future().get();
  EXPECT_EQ(first.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(second.status(), first.status());
  EXPECT_EQ(f.casts.load(), 1);
  EXPECT_EQ(f.shared->kept_bytes(), 0u);
  EXPECT_EQ(f.budget.in_use(), kMaster);
  ASSERT_TRUE(Get(*f.shared, Key(0), kChunk, [&] { return FakeCast(f.casts, 1); }).ok());
  EXPECT_EQ(f.casts.load(), 2) << "the failure was not kept";
}

}  // namespace
}  // namespace layercast::server
