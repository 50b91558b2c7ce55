// Pinned reads against real shards: a walk pinned to a version gets it for
// every layer while newer ones commit, a slow one under a fast publisher
// too (its reads lease the version), and a version no longer kept is
// refused naming the version to walk again at and the flags to raise.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/integration/publish_fixture.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

client::GatherOptions Pinned(uint64_t version, std::optional<uint64_t> base = std::nullopt) {
  client::GatherOptions options;
  options.exact_version = version;
  options.base_version = base;
  return options;
}

TEST_F(PublishTest, APinnedWalkGetsItsVersionForEveryLayerWhileNewerOnesCommit) {
  const client::ShardSet& set = *shards_.set;
  const uint32_t layers = static_cast<uint32_t>(set.model().layers.size());
  ASSERT_GE(layers, 2u);
  const absl::StatusOr<uint64_t> start = set.CurrentVersion();
  ASSERT_TRUE(start.ok()) << start.status();
  ASSERT_EQ(*start, 0u);
  const client::GatherOptions pinned = Pinned(0);
  absl::StatusOr<client::Layer> first = set.Gather(0, pinned);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_NO_FATAL_FAILURE(ExpectHolds(*first, model_.values, 0));

  // Two versions commit while the walk is at layer 0.
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  const auto v1 = Nudged(1.0f / 8);
  const auto v2 = Nudged(1.0f / 4);
  ASSERT_TRUE(publisher.Publish(View(v1)).ok());
  ASSERT_TRUE(publisher.Publish(View(v2)).ok());
  ASSERT_EQ(*set.CurrentVersion(), 2u);
  for (uint32_t l = 1; l < layers; ++l) {
    absl::StatusOr<client::Layer> layer = set.Gather(l, pinned);
    ASSERT_TRUE(layer.ok()) << layer.status();
    ASSERT_NO_FATAL_FAILURE(ExpectHolds(*layer, model_.values, 0));
  }
  // The version in between, and a delta from the pinned one to it.
  absl::StatusOr<client::Layer> middle = set.Gather(1, Pinned(1));
  ASSERT_TRUE(middle.ok()) << middle.status();
  ASSERT_NO_FATAL_FAILURE(ExpectHolds(*middle, v1, 1));
  std::vector<uint8_t> delta(first->bytes().begin(), first->bytes().end());
  const absl::StatusOr<uint64_t> moved = set.GatherInto(0, Pinned(1, 0), delta);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(*moved, 1u);
  absl::StatusOr<client::Layer> full = set.Gather(0, Pinned(1));
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_NO_FATAL_FAILURE(ExpectHolds(*full, v1, 1));
  // Tensor by tensor: the padding between them is never sent.
  for (const AssembledTensor& tensor : set.view().layouts[0].tensors()) {
    const uint64_t bytes = tensor.num_elements * DTypeSize(tensor.compute_dtype);
    EXPECT_EQ(std::memcmp(delta.data() + tensor.byte_offset,
                          full->bytes().data() + tensor.byte_offset, bytes),
              0)
        << "a delta to a kept version differs from its full pull";
  }
  // Unpinned reads get the newest.
  ASSERT_NO_FATAL_FAILURE(ExpectServes(v2, 2));

  // A min_version above the pinned version contradicts it.
  client::GatherOptions contradiction = Pinned(1);
  contradiction.min_version = 2;
  absl::StatusOr<client::Layer> contradictory = set.Gather(0, contradiction);
  EXPECT_EQ(contradictory.status().code(), absl::StatusCode::kInvalidArgument)
      << contradictory.status();
  contradictory = set.Gather(0, Pinned(1, /*base=*/2));
  EXPECT_EQ(contradictory.status().code(), absl::StatusCode::kInvalidArgument)
      << contradictory.status();
  const absl::StatusOr<client::Layer> far = set.Gather(0, Pinned(1000));
  EXPECT_EQ(far.status().code(), absl::StatusCode::kOutOfRange) << far.status();
  EXPECT_THAT(far.status().message(), HasSubstr("exact_version 1000"));
}

// The walk reads a layer every 800 ms while a version commits every 200 ms:
// each layer's version is superseded many times over before the walk gets
// to it, more than the two newest a layer keeps (--pin-versions), and
// still kept, since every read of the walk renews its lease.
TEST_F(PublishTest, ASlowPinnedWalkFinishesUnderAFiveHertzPublisher) {
  const client::ShardSet& set = *shards_.set;
  const uint32_t layers = static_cast<uint32_t>(set.model().layers.size());
  absl::StatusOr<client::Layer> first = set.Gather(0, Pinned(0));
  ASSERT_TRUE(first.ok()) << first.status();
  std::atomic<bool> stop{false};
  std::atomic<int> published{0};
  std::thread publishing([&] {
    client::WeightPublisher publisher(set, {.admin_token = kToken, .insecure = true});
    for (int i = 1; i <= 50 && !stop.load(); ++i) {
      const auto values = Nudged(static_cast<float>(i) / 64);
      if (publisher.Publish(View(values)).ok()) published.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });
  for (uint32_t l = 1; l < layers; ++l) {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    absl::StatusOr<client::Layer> layer = set.Gather(l, Pinned(0));
    EXPECT_TRUE(layer.ok()) << "layer " << l << " after " << published.load()
                            << " publishes: " << layer.status();
    if (layer.ok()) {
      EXPECT_NO_FATAL_FAILURE(ExpectHolds(*layer, model_.values, 0));
    }
  }
  stop = true;
  publishing.join();
  EXPECT_GE(published.load(), 6) << "more versions committed than a layer keeps unleased";
}

TEST(PinnedReadTest, AVersionNoLongerKeptIsRefusedNamingTheVersionToWalkAgainAt) {
  const std::string dir = MakeTempDir("pin-expiry");
  const TestModel model = WriteTestModel(dir + "/model.safetensors", 2, 17);
  RunningShards shards =
      StartShards(2, {"--model", model.path, "--policy", "p=f32,c=bf16", "--pin-retention-ms",
                      "200", "--admin-token-file", WriteAdminToken(dir, kToken)});
  ASSERT_NE(shards.set, nullptr);
  auto values = model.values;
  for (auto& [name, tensor] : values) {
    for (float& value : tensor) value *= 1.5f;
  }
  client::TensorValues view;
  for (const auto& [name, tensor] : values) view.emplace(name, tensor);
  client::WeightPublisher publisher(*shards.set, {.admin_token = kToken, .insecure = true});
  ASSERT_TRUE(publisher.Publish(view).ok());
  // Kept for 200 ms after the commit, or after the last read of it (a
  // walk's lease), then dropped: asked again, less often than that
  // (bounded), until it is gone.
  absl::StatusOr<client::Layer> gone = shards.set->Gather(0, Pinned(0));
  for (int i = 0; i < 30 && gone.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    gone = shards.set->Gather(0, Pinned(0));
  }
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kAborted) << gone.status();
  EXPECT_THAT(gone.status().message(), HasSubstr("no longer keeps version 0"));
  EXPECT_THAT(gone.status().message(), HasSubstr("walk the model again at version 1"));
  EXPECT_THAT(gone.status().message(), HasSubstr("raise --pin-versions or --pin-retention-ms"));
  const absl::StatusOr<client::Layer> now = shards.set->Gather(0, Pinned(1));
  EXPECT_TRUE(now.ok()) << now.status();
}

}  // namespace
}  // namespace layercast::testing
