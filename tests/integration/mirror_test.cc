// A mirror (client::ModelMirror) following publishes to real shards: by
// delta pulls in place, answered by WaitVersion, in full from shards that
// restarted, and in full where a delta would outweigh the layer; the
// manifest command shows a set split between versions.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <limits>
#include <optional>
#include <thread>

#include "tests/integration/publish_fixture.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

TEST_F(PublishTest, AMirrorFollowsEveryPublishInPlace) {
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> created =
      client::ModelMirror::Create(*shards_.set, {.poll = std::chrono::seconds(20)});
  ASSERT_TRUE(created.ok()) << created.status();
  client::ModelMirror& mirror = **created;
  EXPECT_EQ(mirror.version(), 0u);
  const uint32_t layers = static_cast<uint32_t>(shards_.set->model().layers.size());
  std::vector<const uint8_t*> views;
  uint64_t full_bytes = 0;
  {
    auto reading = mirror.Read();
    for (uint32_t l = 0; l < layers; ++l) {
      views.push_back(reading.layer(l).tensor(0).bytes.data());
      full_bytes += reading.layer(l).bytes().size();
    }
  }
  absl::Mutex mu;
  std::vector<client::MirrorUpdate> updates;
  mirror.Follow([&](const client::MirrorUpdate& update) {
    absl::MutexLock lock(&mu);
    updates.push_back(update);
  });

  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  auto values = model_.values;
  for (uint64_t version = 1; version <= 3; ++version) {
    // A small step: a few values change, most of their bf16 bits do not.
    for (auto& [name, tensor] : values) {
      for (size_t i = version; i < tensor.size(); i += 7) tensor[i] *= 1.0f + 1.0f / 32;
    }
    ASSERT_TRUE(publisher.Publish(View(values)).ok());
    ASSERT_TRUE(mirror.WaitForVersion(version, std::chrono::seconds(30))) << version;
    auto reading = mirror.Read();
    EXPECT_EQ(reading.version(), version);
    EXPECT_TRUE(reading.status().ok()) << reading.status();
    for (uint32_t l = 0; l < layers; ++l) {
      const client::Layer& held = reading.layer(l);
      ExpectHoldsAFullPull(held);
      EXPECT_EQ(held.tensor(0).bytes.data(), views[l]) << "the buffer moved";
    }
  }
  {
    // on_update runs after the update lets waiters go: wait for the third.
    absl::MutexLock lock(&mu);
    const auto three = [&updates] { return updates.size() >= 3; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&three), absl::Seconds(30)));
    ASSERT_EQ(updates.size(), 3u);
    for (const client::MirrorUpdate& update : updates) {
      EXPECT_EQ(update.layers, layers);
      EXPECT_GT(update.bytes, 0u);
      EXPECT_LT(update.bytes, full_bytes) << "an update pulled more than the whole model";
    }
  }
  // The follower is parked in a 20 s poll: stopping cancels it.
  const auto start = std::chrono::steady_clock::now();
  mirror.StopFollowing();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  absl::StatusOr<client::MirrorUpdate> update = mirror.Update();
  ASSERT_TRUE(update.ok()) << update.status();
  EXPECT_EQ(update->layers, 0u) << "nothing new to pull";
}

// A staged update pulls while a reader reads on, and holds readers off only
// to copy the changed layers in: the gathers of the update happen while a
// reading is held, and the reading still sees one version throughout.
// A publish that moves (nearly) every value: a delta would carry each
// value and a bitmap besides (6% more than a bf16 layer), so the shards
// refuse it and the mirror pulls those layers in full: its update takes no
// more bytes than a full pull of the model.
TEST_F(PublishTest, AMirrorPullsInFullWhereADeltaWouldOutweighTheLayer) {
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> created =
      client::ModelMirror::Create(*shards_.set, {});
  ASSERT_TRUE(created.ok()) << created.status();
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  const auto moved = Nudged(1.0f / 4);
  auto all = moved;
  for (auto& [name, tensor] : all) {
    for (float& value : tensor) value *= 1.5f;
  }
  ASSERT_TRUE(publisher.Publish(View(moved)).ok());
  absl::StatusOr<client::MirrorUpdate> update = (*created)->Update(1);
  ASSERT_TRUE(update.ok()) << update.status();
  const uint64_t delta_bytes = update->bytes;
  ASSERT_TRUE(publisher.Publish(View(all)).ok());
  update = (*created)->Update(2);
  ASSERT_TRUE(update.ok()) << update.status();

  // The chunk bytes of a full pull of every layer at version 2.
  std::atomic<uint64_t> full_bytes{0};
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    std::vector<uint8_t> buffer(shards_.set->view().layouts[l].total_bytes());
    client::GatherOptions gather;
    gather.on_chunk = [&full_bytes](uint64_t bytes) { full_bytes += bytes; };
    ASSERT_TRUE(shards_.set->GatherInto(l, gather, buffer).ok());
  }
  EXPECT_LT(delta_bytes, full_bytes.load() / 2) << "a third of the values moved: deltas";
  EXPECT_LE(static_cast<double>(update->bytes), 1.005 * static_cast<double>(full_bytes.load()))
      << "every value moved: deltas carrying a bitmap on top of every value";
  auto reading = (*created)->Read();
  for (uint32_t l = 0; l < reading.num_layers(); ++l) {
    ASSERT_NO_FATAL_FAILURE(ExpectHolds(reading.layer(l), all, 2));
  }
}

TEST_F(PublishTest, AStagedUpdatePullsWhileReadersReadAndSwapsWholeVersions) {
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> created = client::ModelMirror::Create(
      *shards_.set, {.staging_bytes = std::numeric_limits<uint64_t>::max()});
  ASSERT_TRUE(created.ok()) << created.status();
  client::ModelMirror& mirror = **created;
  const uint32_t layers = static_cast<uint32_t>(shards_.set->model().layers.size());
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  const auto values = Nudged(1.0f / 16);
  ASSERT_TRUE(publisher.Publish(View(values)).ok());

  const double gathers_before = *CounterValue(*shards_.registry, "layercast_client_gathers_total");
  std::optional<absl::StatusOr<client::MirrorUpdate>> update;
  std::thread updating;
  {
    auto reading = mirror.Read();
    updating = std::thread([&] { update = mirror.Update(); });
    // Every layer's pull lands while this reading holds the mirror (bounded).
    for (int i = 0; i < 200 && *CounterValue(*shards_.registry, "layercast_client_gathers_total") <
                                   gathers_before + layers;
         ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_GE(*CounterValue(*shards_.registry, "layercast_client_gathers_total"),
              gathers_before + layers)
        << "the pulls waited for the reader";
    EXPECT_EQ(reading.version(), 0u) << "the reading still sees the version it began with";
    ExpectHolds(reading.layer(1), model_.values, 0);
  }
  updating.join();
  ASSERT_TRUE(update.has_value() && update->ok()) << (update ? update->status() : absl::Status());
  EXPECT_EQ((*update)->staged_layers, layers);
  EXPECT_LE((*update)->pause, (*update)->duration);
  auto reading = mirror.Read();
  EXPECT_EQ(reading.version(), 1u);
  for (uint32_t l = 0; l < layers; ++l) ExpectHolds(reading.layer(l), values, 1);
  EXPECT_EQ(*CounterValue(*shards_.registry, "layercast_client_mirror_version"), 1);
  EXPECT_EQ(*CounterValue(*shards_.registry, "layercast_client_mirror_lag_versions"), 0);
}

// Version numbers restart with a shard's process: after the set restarts
// without checkpoints, version 1 names other values than it did before. A
// mirror that held the old version 1 asks for a delta from 1 to 2; the
// shards, now another incarnation, refuse it and the mirror pulls in full,
// ending with exactly what they serve. (It used to apply the delta to its
// old values and end with every value that changed between the two version
// 1s wrong, while reporting version 2.)
TEST_F(PublishTest, AMirrorPullsInFullFromShardsThatRestartedInsteadOfAWrongDelta) {
  // Every `every`-th value of each tensor nudged by a quarter.
  const auto nudged_every = [this](size_t every) {
    auto values = model_.values;
    for (auto& [name, tensor] : values) {
      for (size_t i = 0; i < tensor.size(); i += every) tensor[i] *= 1.25f;
    }
    return values;
  };
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  ASSERT_TRUE(publisher.Publish(View(nudged_every(3))).ok());
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> created =
      client::ModelMirror::Create(*shards_.set);
  ASSERT_TRUE(created.ok()) << created.status();
  client::ModelMirror& mirror = **created;
  ASSERT_EQ(mirror.version(), 1u);
  for (uint32_t shard = 0; shard < 2; ++shard) {
    shards_.processes->KillForTest(shard);
    ASSERT_EQ(shards_.processes->RestartForTest(shard), absl::OkStatus());
  }
  // Loaded again (a gather waits out shards still loading), at version 0.
  absl::StatusOr<client::Layer> restarted = shards_.set->Gather(0);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  ASSERT_EQ(restarted->version(), 0u);
  // Version 1 again, now the model's own values; then version 2.
  ASSERT_TRUE(publisher.Publish(View(model_.values)).ok());
  absl::StatusOr<client::PublishResult> second = publisher.Publish(View(nudged_every(5)));
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->version, 2u);
  const std::optional<double> rereads_before =
      CounterValue(*shards_.registry, "layercast_client_rereads_total");
  absl::StatusOr<client::MirrorUpdate> update = mirror.Update();
  ASSERT_TRUE(update.ok()) << update.status();
  auto reading = mirror.Read();
  EXPECT_EQ(reading.version(), 2u);
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    ExpectHoldsAFullPull(reading.layer(l));
  }
  // Seen from the shards' new incarnations before any delta is asked for.
  EXPECT_EQ(CounterValue(*shards_.registry, "layercast_client_rereads_total").value_or(0),
            rereads_before.value_or(0) + shards_.set->model().layers.size())
      << "every layer came in full";
}

// `layercast manifest` shows each shard's version and incarnation, and says
// so when the shards disagree: here shard 1 restarted without a checkpoint
// after a publish, and serves version 0 beside shard 0's 1.
TEST_F(PublishTest, TheManifestCommandShowsASplitSetShardByShard) {
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  ASSERT_TRUE(publisher.Publish(View(Nudged(0.25f))).ok());
  shards_.processes->KillForTest(1);
  ASSERT_EQ(shards_.processes->RestartForTest(1), absl::OkStatus());
  const std::string list =
      absl::StrCat(shards_.processes->addresses()[0], ",", shards_.processes->addresses()[1]);
  std::string output;
  ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " manifest --shards ", list), &output), 0)
      << output;
  EXPECT_THAT(output, HasSubstr("the shards disagree (0 to 1)"));
  EXPECT_THAT(output, HasSubstr(absl::StrCat(shards_.processes->addresses()[0], "  version 1")));
  EXPECT_THAT(output, HasSubstr(absl::StrCat(shards_.processes->addresses()[1], "  version 0")));

  // A worker's gather sees the same split, and its skew gauge says so.
  EXPECT_EQ(CounterValue(*shards_.registry, "layercast_client_version_skew"), 0);
  client::GatherOptions options;
  options.timeout = std::chrono::seconds(3);
  EXPECT_FALSE(shards_.set->Gather(0, options).ok()) << "shard 1 never reaches version 1";
  EXPECT_EQ(CounterValue(*shards_.registry, "layercast_client_version_skew"), 1);
}

// A gather pinned to `version`, a delta from `base` when given.

}  // namespace
}  // namespace layercast::testing
