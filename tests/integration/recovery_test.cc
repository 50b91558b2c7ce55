// A shard SIGKILLed in the middle of a gather and restarted at the same
// address: the worker retries with backoff, reconnects, resumes the shard's
// stream from the first element it had not received, and completes the layer
// bit-identical within the deadline, receiving every byte exactly once.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "core/cast.h"
#include "core/synthetic_model.h"
#include "tests/integration/shard_fixture.h"

namespace layercast::testing {
namespace {

// The embedding is 64 MiB of bf16, sent in 64 KiB chunks.
constexpr char kSpec[] = "llama:layers=1,hidden=1024,ffn=64,vocab=32768,seed=6";

// A shard killed mid-gather comes back as another incarnation: the gather
// waits it out and reads that shard's whole slice again (its version 0
// could name other values after a publish), and none of the other's.
TEST(RecoveryTest, KilledShardRestartsAndTheGatherReadsItsSliceAgain) {
  RunningShards shards = StartShards(2, {"--synthetic", kSpec, "--chunk-bytes", "65536"});
  ASSERT_NE(shards.set, nullptr);
  const AssembledLayout& layout = shards.set->view().layouts[0];
  const uint64_t tensor_bytes = layout.tensors()[0].num_bytes();

  std::atomic<uint64_t> received{0};
  std::atomic<bool> killed{false};
  std::thread restarter;
  client::GatherOptions options;
  options.timeout = std::chrono::seconds(60);
  options.on_chunk = [&](uint64_t bytes) {
    // Throttled so the kill lands while shard 1 still owes most of its part.
    std::this_thread::sleep_for(std::chrono::microseconds(500));
    if (received.fetch_add(bytes) + bytes >= tensor_bytes / 4 && !killed.exchange(true)) {
      shards.processes->KillForTest(1);
      restarter = std::thread([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        EXPECT_TRUE(shards.processes->RestartForTest(1).ok());
      });
    }
  };
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<client::Layer> layer = shards.set->Gather(0, options);
  const auto took = std::chrono::steady_clock::now() - start;
  if (restarter.joinable()) restarter.join();
  ASSERT_TRUE(killed.load()) << "the kill never happened";
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_LT(took, std::chrono::seconds(60));
  const AssembledTensor& tensor = layout.tensors()[0];
  const uint64_t slice1 = (tensor.num_elements - tensor.num_elements / 2) *
                          DTypeSize(tensor.compute_dtype);  // shard 1 of 2's
  EXPECT_GT(received.load(), tensor_bytes) << "the restarted shard's part was resumed, not reread";
  EXPECT_LE(received.load(), tensor_bytes + slice1) << "more than shard 1's slice read again";
  EXPECT_EQ(CounterValue(*shards.registry, "layercast_client_rereads_total"), 1.0);

  auto source = SyntheticModel::Create(kSpec);
  const client::Layer::TensorView view = layer->tensor(0);
  std::vector<float> master(view.num_elements);
  ASSERT_TRUE((*source)->Read(0, 0, ElementRange{0, view.num_elements}, master).ok());
  std::vector<uint8_t> expected(view.bytes.size());
  ASSERT_TRUE(
      CastFromF32(master.data(), expected.data(), master.size(), view.dtype, Fp16Overflow::kError)
          .ok());
  EXPECT_EQ(std::memcmp(expected.data(), view.bytes.data(), expected.size()), 0);
}

// A rolling update: the shard is stopped, and its replacement comes back
// seconds later on the same address. The gather waits for it until its own
// deadline, saying what it waits for, instead of giving up after a few
// attempts.
TEST(RecoveryTest, TheGatherWaitsOutARestartingShard) {
  RunningShards shards = StartShards(2, {"--synthetic", "llama:layers=1,hidden=64,seed=3"});
  ASSERT_NE(shards.set, nullptr);
  shards.processes->SignalForTest(1, SIGTERM);
  absl::StatusOr<int> code = shards.processes->WaitForExitForTest(1, std::chrono::seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  // The replacement comes once the gather has tried more often than the
  // old fixed cap of 8 (bounded in time should the gather give up first).
  std::atomic<int> retries{0};
  std::thread restarter([&] {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (retries.load() < 9 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_TRUE(shards.processes->RestartForTest(1).ok());
  });
  client::GatherOptions options;
  options.timeout = std::chrono::seconds(60);
  options.on_retry = [&](const absl::Status& why, std::chrono::milliseconds) {
    EXPECT_THAT(std::string(why.message()),
                ::testing::HasSubstr("shard 1 (" + shards.processes->addresses()[1] + ")"));
    ++retries;
  };
  absl::StatusOr<client::Layer> layer = shards.set->Gather(0, options);
  restarter.join();
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_GE(retries.load(), 9) << "more attempts than the old fixed cap of 8";
}

TEST(RecoveryTest, WithoutARestartTheGatherFailsNamingTheShard) {
  RunningShards shards = StartShards(2, {"--synthetic", "llama:layers=1,hidden=64"});
  ASSERT_NE(shards.set, nullptr);
  shards.processes->KillForTest(0);
  client::GatherOptions options;
  options.timeout = std::chrono::seconds(3);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<client::Layer> layer = shards.set->Gather(1, options);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  EXPECT_THAT(layer.status().code(), ::testing::AnyOf(absl::StatusCode::kUnavailable,
                                                      absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(std::string(layer.status().message()),
              ::testing::HasSubstr("shard 0 (" + shards.processes->addresses()[0] + ")"));
}

}  // namespace
}  // namespace layercast::testing
