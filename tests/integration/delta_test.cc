// Delta pulls against real training shards: after 1, 2 and K optimizer
// steps a delta from the older copy is bit for bit the full pull, and
// smaller; a base older than K (or a shard that keeps no changes) is
// refused with OUT_OF_RANGE, and the worker library pulls in full. A
// shard records its steps only once a reader has asked for a delta.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "client/gradient_sink.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"
#include "tools/synthetic_gradient.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kDeltaVersions = 3;
constexpr int kSteps = kDeltaVersions + 2;

struct Pulled {
  std::vector<uint8_t> bytes;
  uint64_t version = 0;
  uint64_t received = 0;  // bytes of chunk data (full) or of delta chunks
};

// Pulls `layer` into a copy of `start` (nullopt base: a full pull).
Pulled Pull(const client::ShardSet& set, uint32_t layer, std::vector<uint8_t> start,
            std::optional<uint64_t> base, bool will_pull_deltas = false) {
  Pulled pulled{std::move(start)};
  std::atomic<uint64_t> received{0};
  client::GatherOptions options;
  options.base_version = base;
  options.will_pull_deltas = will_pull_deltas;
  options.on_chunk = [&received](uint64_t bytes) { received += bytes; };
  absl::StatusOr<uint64_t> version = set.GatherInto(layer, options, pulled.bytes);
  EXPECT_TRUE(version.ok()) << version.status();
  pulled.version = version.value_or(UINT64_MAX);
  pulled.received = received;
  return pulled;
}

// Pushes one synthetic gradient of every layer for `step` (one worker:
// each push completes its layer's step).
void Step(const client::ShardSet& set, uint64_t step) {
  absl::StatusOr<std::unique_ptr<client::GradientSink>> sink =
      client::GradientSink::Create(set, {});
  ASSERT_TRUE(sink.ok()) << sink.status();
  for (uint32_t l = 0; l < set.model().layers.size(); ++l) {
    const AssembledLayout& layout = set.view().gradient_layouts[l];
    absl::StatusOr<client::LayerBuffer> gradient =
        client::LayerBuffer::Allocate(layout.total_bytes());
    ASSERT_TRUE(gradient.ok());
    ASSERT_TRUE(
        tools::FillSyntheticGradient(layout, 0, step, l, {gradient->data(), gradient->size()})
            .ok());
    ASSERT_TRUE((*sink)->Push(l, step, *std::move(gradient)).ok());
  }
  ASSERT_TRUE((*sink)->FinishStep(step).ok());
}

class DeltaTest : public ::testing::Test {
 protected:
  // `recording_idle_ms`: --change-recording-idle-ms (0: every step).
  void Start(uint32_t delta_versions, const std::string& recording_idle_ms = "0") {
    model_ = WriteTestModel(MakeTempDir("delta") + "/model.safetensors", 2, 11);
    // A small learning rate: most bfloat16 values stay as they were, some
    // move, as after a real fine-tuning step.
    shards_ = StartShards(
        2, {"--model", model_.path, "--policy", "p=f32,c=bf16;*norm*=f32", "--optimizer",
            "sgd:lr=0.002", "--chunk-bytes", "4096", "--delta-versions",
            std::to_string(delta_versions), "--change-recording-idle-ms", recording_idle_ms});
    ASSERT_NE(shards_.set, nullptr);
  }

  TestModel model_;
  RunningShards shards_;
};

TEST_F(DeltaTest, DeltasAfterOneTwoAndKStepsAreTheFullPull) {
  ASSERT_NO_FATAL_FAILURE(Start(kDeltaVersions));
  const client::ShardSet& set = *shards_.set;
  const uint32_t layers = static_cast<uint32_t>(set.model().layers.size());
  // copies[v][layer]: the full pull at version v.
  std::vector<std::vector<Pulled>> copies(kSteps + 1);
  for (uint32_t l = 0; l < layers; ++l) {
    copies[0].push_back(
        Pull(set, l, std::vector<uint8_t>(set.view().layouts[l].total_bytes()), {}));
  }
  uint64_t delta_bytes = 0, full_bytes = 0;
  for (int v = 1; v <= kSteps; ++v) {
    ASSERT_NO_FATAL_FAILURE(Step(set, v - 1));
    for (uint32_t l = 0; l < layers; ++l) {
      const Pulled full = Pull(set, l, std::vector<uint8_t>(copies[0][l].bytes.size()), {});
      ASSERT_EQ(full.version, static_cast<uint64_t>(v));
      EXPECT_NE(full.bytes, copies[v - 1][l].bytes) << "layer " << l << " did not change";
      copies[v].push_back(full);
      for (int back = 0; back <= static_cast<int>(kDeltaVersions) && back <= v; ++back) {
        const uint64_t base = v - back;
        const Pulled delta = Pull(set, l, copies[base][l].bytes, base);
        ASSERT_EQ(delta.version, static_cast<uint64_t>(v));
        ASSERT_TRUE(delta.bytes == full.bytes)
            << "layer " << l << ": the delta from version " << base << " to " << v
            << " differs from the full pull";
        if (back == 1) {
          delta_bytes += delta.received;
          full_bytes += full.received;
        }
        if (back == 0) {
          EXPECT_LT(delta.received, full.received / 8 + 1024);
        }
      }
    }
  }
  // Some values changed each step, and the deltas carried less than the
  // layers: a bitmap and the changed values.
  EXPECT_LT(delta_bytes, full_bytes);

  // Older than K: refused by the shard, pulled in full by the library.
  const uint64_t too_old = kSteps - kDeltaVersions - 1;
  grpc::ClientContext context;
  layercast::v1::FetchLayerRequest request;
  request.set_layer(0);
  request.set_base_version(too_old);
  auto reader = set.stub(0).FetchLayer(&context, request);
  layercast::v1::LayerChunk chunk;
  while (reader->Read(&chunk)) {
  }
  const grpc::Status refused = reader->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::OUT_OF_RANGE) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("pull the layer in full"));
  constexpr char kFallbacks[] = "layercast_client_delta_fallbacks_total";
  EXPECT_EQ(CounterValue(*shards_.registry, kFallbacks), 0.0) << "every delta above was served";
  for (uint32_t l = 0; l < layers; ++l) {
    const Pulled fallback = Pull(set, l, copies[too_old][l].bytes, too_old);
    EXPECT_TRUE(fallback.bytes == copies[kSteps][l].bytes) << "layer " << l;
    EXPECT_EQ(fallback.received, copies[kSteps][l].received) << "a full pull's bytes";
    EXPECT_EQ(CounterValue(*shards_.registry, kFallbacks), l + 1.0) << "layer " << l;
  }
}

TEST_F(DeltaTest, AShardKeepingNoChangesServesFullPullsInstead) {
  ASSERT_NO_FATAL_FAILURE(Start(0));
  const client::ShardSet& set = *shards_.set;
  const Pulled before = Pull(set, 1, std::vector<uint8_t>(set.view().layouts[1].total_bytes()), {});
  ASSERT_NO_FATAL_FAILURE(Step(set, 0));
  const Pulled full = Pull(set, 1, std::vector<uint8_t>(before.bytes.size()), {});
  const Pulled delta = Pull(set, 1, before.bytes, 0);
  EXPECT_EQ(delta.version, 1u);
  EXPECT_TRUE(delta.bytes == full.bytes);
  EXPECT_EQ(delta.received, full.received);
  EXPECT_EQ(CounterValue(*shards_.registry, "layercast_client_delta_fallbacks_total"), 1.0);
}

// Pulls layer 1 as a delta onto `base` (at `base_version`) and checks that
// it arrived at `version` as a delta: the full pull's bytes, fewer received.
void ExpectDelta(const client::ShardSet& set, const Pulled& base, uint64_t base_version,
                 uint64_t version) {
  const Pulled full = Pull(set, 1, std::vector<uint8_t>(base.bytes.size()), {});
  const Pulled delta = Pull(set, 1, base.bytes, base_version);
  EXPECT_EQ(delta.version, version);
  EXPECT_TRUE(delta.bytes == full.bytes);
  EXPECT_LT(delta.received, full.received) << "a delta, not a full pull";
}

// By default a training shard records nothing until a reader asks for a
// delta: the first delta after start-up is pulled in full, and that pull
// (or the refused request) starts the recording on every shard, so the
// next step's delta is served.
TEST_F(DeltaTest, StepsAreRecordedFromTheFirstDeltaAsked) {
  ASSERT_NO_FATAL_FAILURE(Start(kDeltaVersions, "600000"));
  const client::ShardSet& set = *shards_.set;
  constexpr char kFallbacks[] = "layercast_client_delta_fallbacks_total";
  const Pulled at_zero =
      Pull(set, 1, std::vector<uint8_t>(set.view().layouts[1].total_bytes()), {});
  ASSERT_NO_FATAL_FAILURE(Step(set, 0));
  const Pulled first = Pull(set, 1, at_zero.bytes, 0);
  EXPECT_EQ(first.version, 1u);
  EXPECT_EQ(CounterValue(*shards_.registry, kFallbacks), 1.0) << "step 1 was not recorded";
  ASSERT_NO_FATAL_FAILURE(Step(set, 1));
  ExpectDelta(set, first, 1, 2);
  EXPECT_EQ(CounterValue(*shards_.registry, kFallbacks), 1.0) << "step 2 was recorded";
}

// A full pull that says it will pull deltas (as a mirror's does) starts the
// recording: the first delta after it is served.
TEST_F(DeltaTest, AFullPullThatWillPullDeltasStartsTheRecording) {
  ASSERT_NO_FATAL_FAILURE(Start(kDeltaVersions, "600000"));
  const client::ShardSet& set = *shards_.set;
  const Pulled at_zero = Pull(set, 1, std::vector<uint8_t>(set.view().layouts[1].total_bytes()), {},
                              /*will_pull_deltas=*/true);
  ASSERT_NO_FATAL_FAILURE(Step(set, 0));
  ExpectDelta(set, at_zero, 0, 1);
  EXPECT_EQ(CounterValue(*shards_.registry, "layercast_client_delta_fallbacks_total"), 0.0);
}

}  // namespace
}  // namespace layercast::testing
