// Publishing from an external trainer to real read-only shards: a commit
// makes the new values one version on every shard; a publish that fails on
// one shard (killed mid-publish) leaves every shard serving the version
// before; a shard refuses to commit what it has not staged whole, and drops
// a publish nobody commits; deltas after a publish are the full pull;
// WaitVersion answers when a publish commits.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/integration/publish_fixture.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

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

}  // namespace
}  // namespace layercast::testing
