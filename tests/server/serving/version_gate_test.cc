#include "server/serving/version_gate.h"

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

using Outcome = VersionGate::Outcome;
constexpr auto kNever = std::chrono::steady_clock::time_point::max();

// Callbacks are posted to an io_context the test runs by hand.
struct Gate {
  explicit Gate(uint64_t version) : gate(io.get_executor(), version) {}
  void RunPosted() {
    io.restart();
    io.poll();
  }
  boost::asio::io_context io;
  VersionGate gate;
};

TEST(VersionGateTest, PostsWaitersWhenTheirVersionArrives) {
  Gate g(3);
  int ran = 0;
  g.gate.Wait(2, kNever, [&](Outcome outcome, uint64_t version) {
    EXPECT_EQ(outcome, Outcome::kReached);
    EXPECT_EQ(version, 3u);
    ran += 1;
  });
  EXPECT_EQ(ran, 0) << "even a version already reached is posted, never run inline";
  g.RunPosted();
  EXPECT_EQ(ran, 1);
  const uint64_t five = g.gate.Wait(5, kNever, [&](Outcome, uint64_t) { ran += 10; });
  const uint64_t seven = g.gate.Wait(7, kNever, [&](Outcome, uint64_t) { ran += 100; });
  EXPECT_EQ(g.gate.waiting(), 2u);
  g.gate.Advance(4);
  g.RunPosted();
  EXPECT_EQ(ran, 1);
  g.gate.Advance(6);
  EXPECT_EQ(ran, 1) << "Advance never runs a waiter itself";
  EXPECT_FALSE(g.gate.Cancel(five)) << "posted: the waiter learns of it from its callback";
  g.RunPosted();
  EXPECT_EQ(ran, 11);
  EXPECT_TRUE(g.gate.Cancel(seven));
  g.gate.Advance(9);
  g.RunPosted();
  EXPECT_EQ(ran, 11);
  g.gate.Advance(1);  // never lowers
  EXPECT_EQ(g.gate.version(), 9u);
}

TEST(VersionGateTest, LayersAdvanceOnTheirOwnAndTheModelIsTheLowest) {
  Gate g(2);
  g.gate.SetLayers(3);
  EXPECT_EQ(g.gate.versions(), (std::vector<uint64_t>{2, 2, 2}));
  std::vector<std::pair<uint32_t, uint64_t>> reached;
  for (uint32_t layer : {0u, 1u}) {
    g.gate.Wait(layer, 3, kNever, [&, layer](Outcome outcome, uint64_t version) {
      EXPECT_EQ(outcome, Outcome::kReached);
      reached.emplace_back(layer, version);
    });
  }
  int model_reached = 0;
  g.gate.Wait(3, kNever, [&](Outcome, uint64_t version) {
    EXPECT_EQ(version, 3u);
    ++model_reached;
  });
  g.gate.Advance(1, 3);
  g.RunPosted();
  EXPECT_EQ(reached, (std::vector<std::pair<uint32_t, uint64_t>>{{1, 3}}))
      << "only layer 1's waiter: layer 0 is still at 2";
  EXPECT_EQ(g.gate.version(), 2u);
  EXPECT_EQ(g.gate.version(1), 3u);
  g.gate.Advance(0, 3);
  g.gate.Advance(2, 4);
  g.RunPosted();
  EXPECT_EQ(reached.size(), 2u);
  EXPECT_EQ(model_reached, 1) << "the model reaches 3 with its lowest layer";
  EXPECT_EQ(g.gate.version(), 3u);
  g.gate.Advance(1, 2);  // never lowers
  EXPECT_EQ(g.gate.versions(), (std::vector<uint64_t>{3, 3, 4}));
  g.gate.Advance(5);  // every layer, as a checkpoint's load does
  EXPECT_EQ(g.gate.versions(), (std::vector<uint64_t>{5, 5, 5}));
  g.gate.SetLayers(3);  // nothing changes
  EXPECT_EQ(g.gate.version(2), 5u);
}

TEST(VersionGateTest, CloseEndsEveryWaiterAndEveryLaterOne) {
  Gate g(0);
  std::vector<Outcome> outcomes;
  const auto record = [&](Outcome outcome, uint64_t) { outcomes.push_back(outcome); };
  g.gate.Wait(1, kNever, record);
  g.gate.Wait(2, kNever, record);
  g.gate.Close();
  g.gate.Wait(3, kNever, record);
  g.gate.Wait(0, kNever, record);  // already reached: still served
  g.RunPosted();
  EXPECT_EQ(outcomes, std::vector<Outcome>({Outcome::kClosed, Outcome::kClosed, Outcome::kClosed,
                                            Outcome::kReached}));
  EXPECT_EQ(g.gate.waiting(), 0u);
}

TEST(VersionGateTest, AWaiterGivesUpAtItsTime) {
  boost::asio::thread_pool pool(1);
  platform::ManualClock clock;
  DeadlineTimers timers(clock);
  VersionGate gate(pool.get_executor(), 0, &timers);
  std::promise<Outcome> outcome;
  gate.Wait(1, clock.Now() + std::chrono::milliseconds(100),
            [&](Outcome o, uint64_t) { outcome.set_value(o); });
  clock.Advance(std::chrono::milliseconds(99));
  EXPECT_EQ(gate.waiting(), 1u) << "1 ms before its time";
  clock.Advance(std::chrono::milliseconds(1));
  EXPECT_EQ(gate.waiting(), 0u);
  std::future<Outcome> heard = outcome.get_future();
  ASSERT_EQ(heard.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(heard.get(), Outcome::kTimedOut);
}

// Every waiter hears exactly once, whether the version, a cancel or the
// close comes first, with the version advancing on another thread.
TEST(VersionGateTest, EachWaiterEndsExactlyOnceUnderRaces) {
  boost::asio::thread_pool pool(2);
  VersionGate gate(pool.get_executor(), 0);
  constexpr int kWaiters = 2000;
  std::vector<std::atomic<int>> heard(kWaiters);
  std::atomic<int> cancelled{0};
  std::thread advancer([&] {
    for (uint64_t v = 1; v <= 200; ++v) {
      gate.Advance(v);
      std::this_thread::yield();
    }
  });
  for (int i = 0; i < kWaiters; ++i) {
    const uint64_t id = gate.Wait(static_cast<uint64_t>(i % 250), kNever,
                                  [&heard, i](Outcome, uint64_t) { ++heard[i]; });
    if (i % 3 == 0 && gate.Cancel(id)) {
      ++heard[i];  // the canceller ends it
      ++cancelled;
    }
  }
  advancer.join();
  gate.Close();
  pool.join();
  for (int i = 0; i < kWaiters; ++i) EXPECT_EQ(heard[i].load(), 1) << "waiter " << i;
  EXPECT_GT(cancelled.load(), 0);
}

}  // namespace
}  // namespace layercast::server
