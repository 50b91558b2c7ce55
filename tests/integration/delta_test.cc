// Delta pulls against real training shards: after 1, 2 and K optimizer
// steps a delta from the older copy is bit for bit the full pull, and
// smaller; a base older than K (or a shard that keeps no changes) is
// refused with OUT_OF_RANGE, and the worker library pulls in full. A
// shard records its steps only once a reader has asked for a delta. On
// the wire: a sparse delta to a reader that takes gaps comes as gaps.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>

#include "client/gradient_sink.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "tests/integration/publish_fixture.h"
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

// Read-only shards with an admin token (publish_fixture.h), for a publish
// that changes exactly the values the test chooses.
class GapsOnTheWireTest : public PublishTest {};

// The positions `changed` marks in [from, from + span), coded as shard.proto
// defines LayerChunk.changed_gaps (unsigned LEB128, each gap from the one
// before), and as LayerChunk.changed (bit i of byte i / 8).
void CodePositions(const std::function<bool(uint64_t)>& changed, uint64_t from, uint64_t span,
                   std::string* gaps, std::string* bitmap) {
  gaps->clear();
  bitmap->assign((span + 7) / 8, '\0');
  uint64_t next = 0;
  for (uint64_t i = 0; i < span; ++i) {
    if (!changed(from + i)) continue;
    (*bitmap)[i / 8] = static_cast<char>((*bitmap)[i / 8] | 1 << (i % 8));
    uint64_t gap = i - next;
    for (; gap >= 0x80; gap >>= 7) gaps->push_back(static_cast<char>(0x80 | (gap & 0x7f)));
    gaps->push_back(static_cast<char>(gap));
    next = i + 1;
  }
}

// A publish that negates every 97th value of every tensor, pulled raw
// (FetchLayer through the generated stub) as a delta from the version
// before: to a request with accepts_changed_gaps each chunk's positions
// come as exactly the gaps of the negated elements, with no bitmap, where
// the gaps are smaller (all but a few-element span's); without it, as
// exactly their bitmap.
TEST_F(GapsOnTheWireTest, ASparseDeltaComesAsGapsToAReaderThatTakesThem) {
  constexpr uint64_t kEvery = 97;
  auto values = model_.values;
  for (auto& [name, tensor] : values) {
    for (size_t i = 0; i < tensor.size(); i += kEvery) tensor[i] = tensor[i] == 0 ? 1 : -tensor[i];
  }
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  const absl::StatusOr<client::PublishResult> published = publisher.Publish(View(values), 0);
  ASSERT_TRUE(published.ok()) << published.status();
  ASSERT_EQ(published->version, 1u);
  const client::ShardSet& set = *shards_.set;
  const auto changed = [](uint64_t element) { return element % kEvery == 0; };
  for (const bool accepts_gaps : {true, false}) {
    uint64_t gap_chunks = 0, bitmap_chunks = 0;
    for (uint32_t l = 0; l < set.model().layers.size(); ++l) {
      for (uint32_t s = 0; s < 2; ++s) {
        grpc::ClientContext context;
        layercast::v1::FetchLayerRequest request;
        request.set_layer(l);
        request.set_base_version(0);
        request.set_accepts_changed_gaps(accepts_gaps);
        auto reader = set.stub(s).FetchLayer(&context, request);
        layercast::v1::LayerChunk chunk;
        while (reader->Read(&chunk)) {
          const TensorSpec& tensor = set.model().layers[l].tensors.at(chunk.tensor());
          const std::string where =
              absl::StrCat(tensor.name, " from element ", chunk.element_offset(), ", ",
                           chunk.span_elements(), " elements, gaps accepted ", accepts_gaps);
          ASSERT_EQ(chunk.base_version(), 0u) << where;
          ASSERT_EQ(chunk.version(), 1u) << where;
          std::string gaps, bitmap;
          CodePositions(changed, chunk.element_offset(), chunk.span_elements(), &gaps, &bitmap);
          if (accepts_gaps && gaps.size() < bitmap.size()) {
            EXPECT_EQ(chunk.changed_gaps(), gaps) << where;
            EXPECT_TRUE(chunk.changed().empty()) << where << ": the bitmap sent as well";
            gap_chunks += !gaps.empty();
          } else {
            EXPECT_EQ(chunk.changed(), bitmap) << where;
            EXPECT_TRUE(chunk.changed_gaps().empty()) << where;
            ++bitmap_chunks;
          }
        }
        const grpc::Status status = reader->Finish();
        ASSERT_TRUE(status.ok()) << status.error_message();
      }
    }
    if (accepts_gaps) {
      EXPECT_GT(gap_chunks, 10 * bitmap_chunks) << "gaps went on the wire, bitmaps rarely";
    } else {
      EXPECT_GT(bitmap_chunks, 0u);
    }
  }
}

}  // namespace
}  // namespace layercast::testing
