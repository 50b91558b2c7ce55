#include "server/memory_budget.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace layercast::server {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kNever = Clock::time_point::max();

TEST(MemoryBudgetTest, GrantsAtOnceWhenItFitsAndCountsTheMaster) {
  MemoryBudget budget(1000, 600);
  bool granted = false;
  EXPECT_EQ(budget.Acquire(400, kNever, [&](bool ok) { granted = ok; }), 0u);
  EXPECT_TRUE(granted);
  EXPECT_EQ(budget.in_use(), 1000u);
  EXPECT_TRUE(budget.Grantable(400));
  EXPECT_FALSE(budget.Grantable(401));
  budget.Release(400);
  EXPECT_EQ(budget.in_use(), 600u);
  EXPECT_EQ(budget.peak(), 1000u);
}

TEST(MemoryBudgetTest, WaitersAreGrantedInArrivalOrder) {
  MemoryBudget budget(1000, 0);
  std::vector<int> order;
  budget.Acquire(1000, kNever, [&](bool) { order.push_back(0); });
  budget.Acquire(600, kNever, [&](bool) { order.push_back(1); });
  // Fits after 1 is granted, but must not overtake it.
  budget.Acquire(300, kNever, [&](bool) { order.push_back(2); });
  budget.Acquire(500, kNever, [&](bool) { order.push_back(3); });
  EXPECT_EQ(order, std::vector<int>({0}));
  EXPECT_EQ(budget.waiting(), 3u);
  budget.Release(1000);  // grants 1 (600) and 2 (300); 3 (500) waits
  EXPECT_EQ(order, std::vector<int>({0, 1, 2}));
  EXPECT_EQ(budget.in_use(), 900u);
  budget.Release(600);
  EXPECT_EQ(order, std::vector<int>({0, 1, 2, 3}));
  EXPECT_EQ(budget.in_use(), 800u);
  EXPECT_LE(budget.peak(), 1000u);
}

TEST(MemoryBudgetTest, CancellingTheHeadLetsSmallerRequestsThrough) {
  MemoryBudget budget(1000, 500);
  std::vector<int> order;
  const uint64_t big = budget.Acquire(800, kNever, [&](bool) { order.push_back(0); });
  budget.Acquire(200, kNever, [&](bool) { order.push_back(1); });
  ASSERT_NE(big, 0u);
  EXPECT_TRUE(order.empty());
  EXPECT_TRUE(budget.Cancel(big));
  EXPECT_EQ(order, std::vector<int>({1}));
  EXPECT_FALSE(budget.Cancel(big));
}

TEST(MemoryBudgetTest, AWaiterPastItsDeadlineIsRefused) {
  MemoryBudget budget(100, 100);
  std::atomic<int> result{-1};
  const auto start = Clock::now();
  ASSERT_NE(budget.Acquire(10, start + std::chrono::milliseconds(100),
                           [&](bool ok) { result = ok ? 1 : 0; }),
            0u);
  for (int i = 0; i < 500 && result.load() < 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(result.load(), 0);
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(100));
  EXPECT_EQ(budget.waiting(), 0u);
  EXPECT_EQ(budget.in_use(), 100u);
}

TEST(MemoryBudgetTest, ConcurrentUseNeverExceedsTheBudget) {
  MemoryBudget budget(10'000, 4'000);
  std::atomic<uint64_t> granted_total{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        const uint64_t bytes = 500 + 250 * ((t + i) % 8);
        std::atomic<bool> done{false};
        budget.Acquire(bytes, kNever, [&](bool ok) {
          EXPECT_TRUE(ok);
          done = true;
        });
        for (int spin = 0; spin < 100000 && !done.load(); ++spin) std::this_thread::yield();
        ASSERT_TRUE(done.load());
        granted_total += bytes;
        budget.Release(bytes);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_LE(budget.peak(), 10'000u);
  EXPECT_EQ(budget.in_use(), 4'000u);
  EXPECT_GT(granted_total.load(), 0u);
}

}  // namespace
}  // namespace layercast::server
