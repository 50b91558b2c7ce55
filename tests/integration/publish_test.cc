// Publishing from an external trainer to real read-only shards: a commit
// makes the new values one version on every shard; a publish that fails on
// one shard (killed mid-publish) leaves every shard serving the version
// before; a shard refuses to commit what it has not staged whole, and drops
// a publish nobody commits; deltas after a publish are the full pull; a
// mirror follows publishes by delta pulls in place (WaitVersion); a walk
// pinned to a version gets it for every layer while newer ones commit.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/model_mirror.h"
#include "client/weight_publisher.h"
#include "core/cast.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kToken[] = "publish-token-0123456789abcdef";

class PublishTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = MakeTempDir("publish");
    model_ = WriteTestModel(dir + "/model.safetensors", 2, 17);
    shards_ = StartShards(
        2, {"--model", model_.path, "--policy", "p=f32,c=bf16;*norm*=f32", "--chunk-bytes", "4096",
            "--admin-token-file", WriteAdminToken(dir, kToken)});
    ASSERT_NE(shards_.set, nullptr);
  }

  // The model's values, each nudged by a relative `step` where `pick`.
  std::map<std::string, std::vector<float>> Nudged(float step) const {
    std::map<std::string, std::vector<float>> nudged = model_.values;
    for (auto& [name, values] : nudged) {
      for (size_t i = 0; i < values.size(); i += 3) values[i] *= 1 + step;
    }
    return nudged;
  }

  static client::TensorValues View(const std::map<std::string, std::vector<float>>& values) {
    client::TensorValues view;
    for (const auto& [name, tensor] : values) view.emplace(name, tensor);
    return view;
  }

  uint64_t ManifestVersion(uint32_t shard) const {
    grpc::ClientContext context;
    layercast::v1::Manifest manifest;
    const grpc::Status status = shards_.set->stub(shard).GetManifest(&context, {}, &manifest);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return manifest.version();
  }

  // Every layer gathered whole, and checked against `values` cast to each
  // tensor's compute dtype.
  void ExpectServes(const std::map<std::string, std::vector<float>>& values, uint64_t version) {
    for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
      absl::StatusOr<client::Layer> layer = shards_.set->Gather(l);
      ASSERT_TRUE(layer.ok()) << layer.status();
      ASSERT_NO_FATAL_FAILURE(ExpectHolds(*layer, values, version));
    }
  }

  // `layer` is at `version` and holds `values` cast to each tensor's
  // compute dtype.
  void ExpectHolds(const client::Layer& layer,
                   const std::map<std::string, std::vector<float>>& values, uint64_t version) {
    EXPECT_EQ(layer.version(), version);
    const AssembledLayout& layout = shards_.set->view().layouts[layer.index()];
    for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
      const AssembledTensor& tensor = layout.tensors()[t];
      const std::string& name = shards_.set->model().layers[layer.index()].tensors[t].name;
      const std::vector<float>& expected = values.at(name);
      std::vector<uint8_t> cast(expected.size() * DTypeSize(tensor.compute_dtype));
      ASSERT_TRUE(CastFromF32(expected.data(), cast.data(), expected.size(), tensor.compute_dtype,
                              Fp16Overflow::kInfinity)
                      .ok());
      ASSERT_EQ(std::memcmp(layer.bytes().data() + tensor.byte_offset, cast.data(), cast.size()), 0)
          << name << " at version " << version;
    }
  }

  // Layer `layer` as a full pull gives it now, padding zeroed.
  std::vector<uint8_t> Bytes(uint32_t layer) const {
    std::vector<uint8_t> bytes(shards_.set->view().layouts[layer].total_bytes());
    const absl::StatusOr<uint64_t> version = shards_.set->GatherInto(layer, {}, bytes);
    EXPECT_TRUE(version.ok()) << version.status();
    return bytes;
  }

  // A mirror's `held` layer has every tensor's bytes as a full pull gives
  // them now (padding aside).
  void ExpectHoldsAFullPull(const client::Layer& held) const {
    const std::vector<uint8_t> full = Bytes(held.index());
    for (size_t t = 0; t < held.num_tensors(); ++t) {
      const std::span<const uint8_t> tensor = held.tensor(t).bytes;
      EXPECT_EQ(std::memcmp(tensor.data(), full.data() + (tensor.data() - held.bytes().data()),
                            tensor.size()),
                0)
          << held.tensor(t).name << " at version " << held.version();
    }
  }

  std::unique_ptr<layercast::v1::ShardAdmin::Stub> Admin(uint32_t shard) const {
    return layercast::v1::ShardAdmin::NewStub(shards_.set->channel(shard));
  }
  static void Authorize(grpc::ClientContext& context) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  }

  TestModel model_;
  RunningShards shards_;
};

TEST_F(PublishTest, ACommitMakesTheNewValuesOneVersionOnEveryShard) {
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  ASSERT_NO_FATAL_FAILURE(ExpectServes(model_.values, 0));
  std::vector<std::vector<uint8_t>> before;
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    before.push_back(Bytes(l));
  }
  const auto first = Nudged(1.0f / 64);
  absl::StatusOr<client::PublishResult> published = publisher.Publish(View(first));
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(published->version, 1u);
  EXPECT_FALSE(published->layer_by_layer);
  EXPECT_GT(published->changed_elements, 0u);
  EXPECT_EQ(ManifestVersion(0), 1u);
  EXPECT_EQ(ManifestVersion(1), 1u);
  ASSERT_NO_FATAL_FAILURE(ExpectServes(first, 1));

  // Only one layer this time: the others keep their values, at version 2.
  auto second = first;
  const LayerSpec& layer1 = shards_.set->model().layers[1];
  std::map<std::string, std::vector<float>> only_layer1;
  for (const TensorSpec& tensor : layer1.tensors) {
    for (float& value : second[tensor.name]) value = -value;
    only_layer1[tensor.name] = second[tensor.name];
  }
  published = publisher.Publish(View(only_layer1));
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(published->version, 2u);
  ASSERT_NO_FATAL_FAILURE(ExpectServes(second, 2));

  // A worker holding version 0 pulls only what the two publishes changed.
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    client::GatherOptions options;
    options.base_version = 0;
    std::vector<uint8_t> copy = before[l];
    absl::StatusOr<uint64_t> version = shards_.set->GatherInto(l, options, copy);
    ASSERT_TRUE(version.ok()) << version.status();
    EXPECT_EQ(*version, 2u);
    EXPECT_TRUE(copy == Bytes(l)) << "layer " << l;
  }

  // Bad input changes nothing.
  auto partial = only_layer1;
  partial.erase(partial.begin());
  EXPECT_THAT(publisher.Publish(View(partial)).status().message(), HasSubstr("given in part"));
  std::map<std::string, std::vector<float>> unknown{{"no.such.tensor", {1.0f}}};
  EXPECT_THAT(publisher.Publish(View(unknown)).status().message(), HasSubstr("not in the model"));
  EXPECT_EQ(ManifestVersion(0), 2u);
  // A publish on a stale base names the version the shards do serve.
  const absl::StatusOr<client::PublishResult> stale = publisher.Publish(View(second), 0);
  EXPECT_THAT(stale.status().message(), HasSubstr("which still serve version 2"));
}

// Deltas in either form of the changed positions (gaps where smaller, or
// the bitmap an older worker asks for) are the full pull after 1, 2 and 3
// versions, whatever share of the values changed, anywhere in a chunk.
TEST_F(PublishTest, DeltasInEitherFormAreTheFullPullAtEveryShareChanged) {
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  const auto layers = static_cast<uint32_t>(shards_.set->model().layers.size());
  std::vector<std::vector<std::vector<uint8_t>>> held(1);  // [version][layer]
  for (uint32_t l = 0; l < layers; ++l) held[0].push_back(Bytes(l));
  auto values = model_.values;
  std::mt19937 random(7);
  for (const double share : {0.0, 0.001, 0.01, 0.1, 0.9}) {
    std::bernoulli_distribution pick(share);
    for (auto& [name, tensor] : values) {
      // Negated, a value changes in every dtype (zero becomes one).
      for (float& value : tensor) {
        if (pick(random)) value = value == 0 ? 1 : -value;
      }
    }
    absl::StatusOr<client::PublishResult> published = publisher.Publish(View(values));
    ASSERT_TRUE(published.ok()) << published.status();
    const uint64_t version = published->version;
    held.emplace_back();
    for (uint32_t l = 0; l < layers; ++l) held[version].push_back(Bytes(l));
    for (uint64_t back = 1; back <= std::min<uint64_t>(version, 3); ++back) {
      for (const bool gaps : {true, false}) {
        for (uint32_t l = 0; l < layers; ++l) {
          client::GatherOptions options;
          options.base_version = version - back;
          options.changed_gaps = gaps;
          std::vector<uint8_t> copy = held[version - back][l];
          absl::StatusOr<uint64_t> pulled = shards_.set->GatherInto(l, options, copy);
          ASSERT_TRUE(pulled.ok()) << pulled.status();
          EXPECT_EQ(*pulled, version);
          EXPECT_TRUE(copy == held[version][l])
              << "layer " << l << " from version " << version - back << " to " << version
              << " with " << share << " changed, " << (gaps ? "gaps allowed" : "bitmap only");
        }
      }
    }
  }
  EXPECT_EQ(CounterValue(*shards_.registry, "layercast_client_delta_fallbacks_total").value_or(0),
            0)
      << "every delta served as a delta";
}

TEST_F(PublishTest, AShardKilledMidPublishLeavesTheVersionBeforeServingEverywhere) {
  shards_.processes->KillForTest(1);
  client::WeightPublisher publisher(
      *shards_.set, {.admin_token = kToken, .insecure = true, .timeout = std::chrono::seconds(3)});
  // The trainer publishes on top of the version it read (0): shard 0
  // begins and stages, shard 1 is gone.
  const absl::StatusOr<client::PublishResult> published =
      publisher.Publish(View(Nudged(0.5f)), /*base_version=*/0);
  ASSERT_FALSE(published.ok());
  EXPECT_THAT(published.status().message(), HasSubstr("aborted on every shard"));
  // Shard 0 staged (or not) and was told to abort: it serves version 0,
  // and no publish is left open there.
  EXPECT_EQ(ManifestVersion(0), 0u);
  ASSERT_TRUE(shards_.processes->RestartForTest(1).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectServes(model_.values, 0));
  client::WeightPublisher again(*shards_.set, {.admin_token = kToken, .insecure = true});
  const auto values = Nudged(0.25f);
  ASSERT_TRUE(again.Publish(View(values)).ok()) << "a publish was left open";
  ASSERT_NO_FATAL_FAILURE(ExpectServes(values, 1));
}

TEST_F(PublishTest, AShardCommitsOnlyWhatItStagedWholeAndDropsWhatNobodyCommits) {
  auto admin = Admin(0);
  layercast::v1::BeginPublishRequest begin;
  begin.set_publish_id("partial");
  begin.set_base_version(0);
  begin.add_layers(1);
  begin.set_timeout_ms(500);
  layercast::v1::BeginPublishResponse begun;
  {
    grpc::ClientContext context;
    Authorize(context);
    ASSERT_TRUE(admin->BeginPublish(&context, begin, &begun).ok());
    EXPECT_GT(begun.staging_bytes(), 0u);
  }
  {
    grpc::ClientContext context;
    Authorize(context);
    layercast::v1::BeginPublishRequest other = begin;
    other.set_publish_id("other");
    // One publish at a time: with peers (the local set's --peers-file) the
    // open one is settled once idle, and the publisher retries meanwhile.
    const grpc::Status status = admin->BeginPublish(&context, other, &begun);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << "one publish at a time";
    EXPECT_THAT(status.error_message(), HasSubstr("begin again shortly"));
  }
  {
    // One chunk of the first tensor, not the rest.
    grpc::ClientContext context;
    Authorize(context);
    layercast::v1::StagePublishResponse staged;
    auto writer = admin->StagePublish(&context, &staged);
    const TensorSpec& tensor = shards_.set->model().layers[1].tensors[0];
    layercast::v1::PublishChunk chunk;
    chunk.set_publish_id("partial");
    chunk.set_layer(1);
    chunk.set_tensor(0);
    chunk.set_element_offset(0);
    chunk.set_dtype(layercast::v1::FLOAT32);
    chunk.set_data(std::string(4 * 3, '\0'));
    ASSERT_TRUE(writer->Write(chunk));
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(staged.elements(), 3u) << tensor.name;
  }
  {
    grpc::ClientContext context;
    Authorize(context);
    layercast::v1::CommitPublishRequest commit;
    commit.set_publish_id("partial");
    layercast::v1::CommitPublishResponse response;
    const grpc::Status status = admin->CommitPublish(&context, commit, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(), HasSubstr("not staged whole"));
  }
  EXPECT_EQ(ManifestVersion(0), 0u);
  // Nobody commits: once its timeout passes, shard 0, which decides, has
  // dropped it for good. Asked until then (a commit of a publish not
  // staged whole changes nothing), within a bound.
  grpc::Status status;
  for (const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       std::chrono::steady_clock::now() < give_up;
       std::this_thread::sleep_for(std::chrono::milliseconds(20))) {
    grpc::ClientContext context;
    Authorize(context);
    layercast::v1::CommitPublishRequest commit;
    commit.set_publish_id("partial");
    layercast::v1::CommitPublishResponse response;
    status = admin->CommitPublish(&context, commit, &response);
    if (status.error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("never committed"));
  ASSERT_NO_FATAL_FAILURE(ExpectServes(model_.values, 0));
}

TEST_F(PublishTest, WaitVersionAnswersWhenAPublishCommits) {
  const auto wait = [this](uint64_t min_version, std::chrono::milliseconds deadline) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    layercast::v1::WaitVersionRequest request;
    request.set_min_version(min_version);
    layercast::v1::WaitVersionResponse response;
    const grpc::Status status = shards_.set->stub(1).WaitVersion(&context, request, &response);
    return std::make_pair(status, response.version());
  };
  std::pair<grpc::Status, uint64_t> answer;
  std::thread waiter([&] { answer = wait(1, std::chrono::seconds(30)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  ASSERT_TRUE(publisher.Publish(View(Nudged(1.0f / 8))).ok());
  waiter.join();
  EXPECT_TRUE(answer.first.ok()) << answer.first.error_message();
  EXPECT_EQ(answer.second, 1u);

  // A version that does not come is the version now, before the deadline.
  const auto start = std::chrono::steady_clock::now();
  answer = wait(2, std::chrono::milliseconds(1000));
  EXPECT_TRUE(answer.first.ok()) << answer.first.error_message();
  EXPECT_EQ(answer.second, 1u);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
  answer = wait(1000, std::chrono::milliseconds(1000));
  EXPECT_EQ(answer.first.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(answer.first.error_message(), HasSubstr("--max-version-lead"));
}

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
  const std::optional<double> fallbacks_before =
      CounterValue(*shards_.registry, "layercast_client_delta_fallbacks_total");
  absl::StatusOr<client::MirrorUpdate> update = mirror.Update();
  ASSERT_TRUE(update.ok()) << update.status();
  auto reading = mirror.Read();
  EXPECT_EQ(reading.version(), 2u);
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    ExpectHoldsAFullPull(reading.layer(l));
  }
  EXPECT_GE(CounterValue(*shards_.registry, "layercast_client_delta_fallbacks_total").value_or(0),
            fallbacks_before.value_or(0) + shards_.set->model().layers.size())
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
  // Kept for 200 ms after the commit, then dropped: asked again (bounded)
  // until it is gone.
  absl::StatusOr<client::Layer> gone = shards.set->Gather(0, Pinned(0));
  for (int i = 0; i < 50 && gone.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    gone = shards.set->Gather(0, Pinned(0));
  }
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kAborted) << gone.status();
  EXPECT_THAT(gone.status().message(), HasSubstr("no longer keeps version 0"));
  EXPECT_THAT(gone.status().message(), HasSubstr("walk the model again at version 1"));
  const absl::StatusOr<client::Layer> now = shards.set->Gather(0, Pinned(1));
  EXPECT_TRUE(now.ok()) << now.status();
}

}  // namespace
}  // namespace layercast::testing
