// ChunkPool on its own: buffers come back through the slice's destroy
// callback and are reused, kept ones are charged to the budget (never
// beyond it), Drain returns them, and a slice may outlive its pool.

#include "server/serving/chunk_pool.h"

#include <gtest/gtest.h>
#include <boost/asio/thread_pool.hpp>

#include <cstring>
#include <optional>
#include <thread>
#include <vector>

namespace layercast::server {
namespace {

constexpr uint64_t kMaster = 1000;
constexpr uint64_t kBuffer = 4096;

struct Fixture {
  explicit Fixture(std::optional<uint64_t> budget_bytes = std::nullopt)
      : budget(budget_bytes, kMaster, grants.get_executor()) {}
  boost::asio::thread_pool grants{1};
  MemoryBudget budget;
};

TEST(ChunkPoolTest, BuffersComeBackWithTheSliceAndAreReused) {
  Fixture f;
  ChunkPool pool(kBuffer, 4, f.budget);
  const uint8_t* first = nullptr;
  {
    absl::StatusOr<ChunkPool::Lent> lent = pool.Take(100);
    ASSERT_TRUE(lent.ok()) << lent.status();
    EXPECT_EQ(lent->slice.size(), 100u);
    EXPECT_EQ(lent->slice.begin(), lent->data);
    std::memset(lent->data, 7, 100);
    first = lent->data;
    EXPECT_EQ(pool.idle_buffers(), 0u);
  }
  EXPECT_EQ(pool.idle_buffers(), 1u);
  EXPECT_EQ(pool.charged_bytes(), kBuffer);
  EXPECT_EQ(f.budget.in_use(), kMaster + kBuffer);
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<ChunkPool::Lent> again = pool.Take(kBuffer);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->data, first) << "the same buffer, turn " << i;
  }
  EXPECT_EQ(pool.buffers_made(), 1u);
  EXPECT_EQ(f.budget.in_use(), kMaster + kBuffer) << "charged once, not per turn";
}

TEST(ChunkPoolTest, ASliceCopiedElsewhereReturnsItsBufferWithTheLastCopy) {
  Fixture f;
  ChunkPool pool(kBuffer, 4, f.budget);
  std::optional<grpc::Slice> kept;
  {
    absl::StatusOr<ChunkPool::Lent> lent = pool.Take(kBuffer);
    ASSERT_TRUE(lent.ok());
    kept = lent->slice;  // a second reference, as SharedChunks keeps one
  }
  EXPECT_EQ(pool.idle_buffers(), 0u);
  kept.reset();
  EXPECT_EQ(pool.idle_buffers(), 1u);
}

TEST(ChunkPoolTest, AtMostMaxBuffersAreKeptAndLargerChunksAreNotPooled) {
  Fixture f;
  ChunkPool pool(kBuffer, 2, f.budget);
  {
    std::vector<ChunkPool::Lent> lent;
    for (int i = 0; i < 3; ++i) lent.push_back(*pool.Take(kBuffer));
    EXPECT_EQ(pool.buffers_made(), 3u);
  }
  EXPECT_EQ(pool.idle_buffers(), 2u);
  EXPECT_EQ(f.budget.in_use(), kMaster + 2 * kBuffer);
  {
    absl::StatusOr<ChunkPool::Lent> large = pool.Take(kBuffer + 1);
    ASSERT_TRUE(large.ok());
    EXPECT_EQ(large->slice.size(), kBuffer + 1);
  }
  EXPECT_EQ(pool.buffers_made(), 3u);
  EXPECT_EQ(pool.idle_buffers(), 2u);
}

TEST(ChunkPoolTest, KeptBuffersNeverGoBeyondTheBudgetAndDrainGivesThemBack) {
  Fixture f(kMaster + kBuffer + kBuffer / 2);
  ChunkPool pool(kBuffer, 8, f.budget);
  {
    std::vector<ChunkPool::Lent> lent;
    for (int i = 0; i < 2; ++i) lent.push_back(*pool.Take(kBuffer));
  }
  EXPECT_EQ(pool.idle_buffers(), 1u) << "the budget took one buffer, not two";
  EXPECT_EQ(f.budget.in_use(), kMaster + kBuffer);
  pool.Drain();
  EXPECT_EQ(pool.idle_buffers(), 0u);
  EXPECT_EQ(pool.charged_bytes(), 0u);
  EXPECT_EQ(f.budget.in_use(), kMaster);
}

TEST(ChunkPoolTest, ASliceMayOutliveItsPool) {
  Fixture f;
  std::optional<grpc::Slice> survivor;
  {
    ChunkPool pool(kBuffer, 4, f.budget);
    { ChunkPool::Lent warm = *pool.Take(kBuffer); }  // charged, idle
    survivor = pool.Take(kBuffer)->slice;            // the charged one, lent
    EXPECT_EQ(f.budget.in_use(), kMaster + kBuffer);
  }
  EXPECT_EQ(f.budget.in_use(), kMaster) << "the pool's end returns what it charged";
  survivor.reset();  // freed, not pooled: the pool is gone
  EXPECT_EQ(f.budget.in_use(), kMaster);
}

TEST(ChunkPoolTest, ManyThreadsTakeAndReturn) {
  Fixture f;
  ChunkPool pool(kBuffer, 4, f.budget);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool] {
      for (int i = 0; i < 500; ++i) {
        absl::StatusOr<ChunkPool::Lent> lent = pool.Take(kBuffer);
        ASSERT_TRUE(lent.ok());
        lent->data[0] = static_cast<uint8_t>(i);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_LE(pool.buffers_made(), 4u + 4u);
  EXPECT_LE(pool.idle_buffers(), 4u);
  EXPECT_EQ(f.budget.in_use(), kMaster + pool.charged_bytes());
}

}  // namespace
}  // namespace layercast::server
