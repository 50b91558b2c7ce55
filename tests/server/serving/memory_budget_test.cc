#include "server/serving/memory_budget.h"

#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/thread_pool.hpp>
#include <future>
#include <thread>
#include <vector>

#include "platform/clock.h"
#include "server/serving/deadline_timers.h"

namespace layercast::server {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kNever = Clock::time_point::max();

// Grants are posted to an io_context the test runs by hand: nothing a call
// grants has run until the test polls.
struct Budget {
  Budget(uint64_t budget_bytes, uint64_t master)
      : budget(budget_bytes, master, grants.get_executor()) {}
  // Runs the grants posted so far.
  void RunGrants() {
    grants.restart();
    grants.poll();
  }
  boost::asio::io_context grants;
  MemoryBudget budget;
};

TEST(MemoryBudgetTest, GrantsWhenItFitsAndCountsTheMaster) {
  Budget b(1000, 600);
  bool granted = false;
  b.budget.Acquire(400, kNever, [&](bool ok) { granted = ok; });
  EXPECT_FALSE(granted) << "a grant never runs on the caller's thread";
  EXPECT_EQ(b.budget.in_use(), 1000u);
  b.RunGrants();
  EXPECT_TRUE(granted);
  EXPECT_TRUE(b.budget.Grantable(400));
  EXPECT_FALSE(b.budget.Grantable(401));
  b.budget.Release(400);
  EXPECT_EQ(b.budget.in_use(), 600u);
  EXPECT_EQ(b.budget.peak(), 1000u);
}

TEST(MemoryBudgetTest, WaitersAreGrantedInArrivalOrder) {
  Budget b(1000, 0);
  std::vector<int> order;
  b.budget.Acquire(1000, kNever, [&](bool) { order.push_back(0); });
  b.budget.Acquire(600, kNever, [&](bool) { order.push_back(1); });
  // Fits after 1 is granted, but must not overtake it.
  b.budget.Acquire(300, kNever, [&](bool) { order.push_back(2); });
  b.budget.Acquire(500, kNever, [&](bool) { order.push_back(3); });
  b.RunGrants();
  EXPECT_EQ(order, std::vector<int>({0}));
  EXPECT_EQ(b.budget.waiting(), 3u);
  b.budget.Release(1000);  // grants 1 (600) and 2 (300); 3 (500) waits
  EXPECT_EQ(order, std::vector<int>({0})) << "Release never runs a waiter's callback itself";
  b.RunGrants();
  EXPECT_EQ(order, std::vector<int>({0, 1, 2}));
  EXPECT_EQ(b.budget.in_use(), 900u);
  b.budget.Release(600);
  b.RunGrants();
  EXPECT_EQ(order, std::vector<int>({0, 1, 2, 3}));
  EXPECT_EQ(b.budget.in_use(), 800u);
  EXPECT_LE(b.budget.peak(), 1000u);
}

TEST(MemoryBudgetTest, CancellingTheHeadLetsSmallerRequestsThrough) {
  Budget b(1000, 500);
  std::vector<int> order;
  const uint64_t big = b.budget.Acquire(800, kNever, [&](bool) { order.push_back(0); });
  b.budget.Acquire(200, kNever, [&](bool) { order.push_back(1); });
  b.RunGrants();
  EXPECT_TRUE(order.empty());
  EXPECT_TRUE(b.budget.Cancel(big));
  EXPECT_TRUE(order.empty()) << "Cancel never runs a waiter's callback itself";
  b.RunGrants();
  EXPECT_EQ(order, std::vector<int>({1}));
  EXPECT_FALSE(b.budget.Cancel(big));
}

TEST(MemoryBudgetTest, AGrantedRequestCannotBeCancelled) {
  Budget b(1000, 0);
  bool granted = false;
  const uint64_t id = b.budget.Acquire(100, kNever, [&](bool ok) { granted = ok; });
  // Posted but not yet run: the requester learns of it from the callback.
  EXPECT_FALSE(b.budget.Cancel(id));
  b.RunGrants();
  EXPECT_TRUE(granted);
}

TEST(MemoryBudgetTest, AWaiterPastItsDeadlineIsRefused) {
  boost::asio::thread_pool grants(1);
  platform::ManualClock clock;
  DeadlineTimers timers(clock);
  MemoryBudget budget(100, 100, grants.get_executor(), {}, &timers);
  std::promise<bool> result;
  budget.Acquire(10, clock.Now() + std::chrono::milliseconds(100),
                 [&](bool ok) { result.set_value(ok); });
  clock.Advance(std::chrono::milliseconds(99));
  EXPECT_EQ(budget.waiting(), 1u) << "1 ms before its deadline";
  clock.Advance(std::chrono::milliseconds(1));
  std::future<bool> heard = result.get_future();
  ASSERT_EQ(heard.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_FALSE(heard.get());
  EXPECT_EQ(budget.waiting(), 0u);
  EXPECT_EQ(budget.in_use(), 100u);
}

TEST(MemoryBudgetTest, ConcurrentUseNeverExceedsTheBudget) {
  boost::asio::thread_pool grants(2);
  MemoryBudget budget(10'000, 4'000, grants.get_executor());
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
        for (int spin = 0; spin < 1000 && !done.load(); ++spin) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
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
