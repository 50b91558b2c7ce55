// Training that survives a shard's death at any point of a step
// (docs/recovery.md): a shard of a two-worker training set is killed at a
// named failpoint (platform/failpoint.h) and restarted as Kubernetes would, with
// the same flags and checkpoint directory. The workers are not told: they
// retry, the restarted shard replays its push journal over its checkpoint,
// and the run ends bit for bit where the same run without a death ends.

#include <gtest/gtest.h>

#include <cctype>
#include <cstring>
#include <filesystem>
#include <optional>

#include "client/gradient_sink.h"
#include "client/shard_set.h"
#include "tests/chaos/shard_restarter.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"
#include "tools/local_shard_set.h"
#include "tools/synthetic_gradient.h"

namespace layercast::testing {
namespace {

constexpr int kLayers = 2;
constexpr uint64_t kSeed = 29;
constexpr uint32_t kWorkers = 2;
constexpr uint64_t kSteps = 6;
// fp32 compute, so that a gather is the master itself, bit for bit.
constexpr char kPolicy[] = "p=f32,c=f32";
constexpr char kOptimizer[] = "adamw:lr=1e-2,weight_decay=0.1";
constexpr uint64_t kChunkBytes = 4096;
// A gather or a push waits this long for a shard that restarts.
constexpr auto kPatience = std::chrono::seconds(60);

// Every tensor's bytes after the run, layer by layer.
using Weights = std::vector<std::vector<uint8_t>>;

class TrainingChaos {
 public:
  // `failpoint`, armed in the shards only, fires once over the set's life.
  explicit TrainingChaos(const std::string& failpoint) {
    dir_ = MakeTempDir("training-chaos");
    const TestModel model = WriteTestModel(dir_ + "/model.safetensors", kLayers, kSeed);
    std::filesystem::create_directory(dir_ + "/checkpoints");
    tools::LocalShardSet::Options options;
    options.shard_binary = ShardBinary();
    options.num_shards = 2;
    options.extra_flags = {"--model",
                           model.path,
                           "--policy",
                           kPolicy,
                           "--optimizer",
                           kOptimizer,
                           "--data-parallel-workers",
                           std::to_string(kWorkers),
                           "--chunk-bytes",
                           std::to_string(kChunkBytes),
                           "--cast-isa",
                           "widest",
                           "--checkpoint-dir",
                           dir_ + "/checkpoints",
                           "--checkpoint-every",
                           "2"};
    options.log_dir = dir_;
    if (!failpoint.empty()) {
      options.environment = {"LAYERCAST_FAILPOINT=" + failpoint,
                             "LAYERCAST_FAILPOINT_ONCE=" + fired()};
    }
    auto processes = tools::LocalShardSet::Start(options);
    EXPECT_TRUE(processes.ok()) << processes.status();
    if (!processes.ok()) return;
    processes_ = *std::move(processes);
    auto set = client::ShardSet::Connect(processes_->addresses(), {});
    EXPECT_TRUE(set.ok()) << set.status();
    if (set.ok()) set_ = *std::move(set);
    // As a StatefulSet's controller would, until the run ends.
    restarter_.emplace(*processes_);
  }
  ~TrainingChaos() { (void)Stop(); }

  bool started() const { return set_ != nullptr; }
  std::string fired() const { return dir_ + "/fired"; }

  // Stops restarting, then every shard (SIGTERM): OK if each exited 0 (no
  // leak, no sanitizer report).
  absl::Status Stop() {
    if (restarter_.has_value()) restarter_->Stop();
    return processes_ != nullptr ? processes_->Stop() : absl::OkStatus();
  }
  // The shards that died (and were restarted, if by SIGKILL) until Stop().
  std::vector<ShardRestarter::Death> deaths() const {
    return restarter_.has_value() ? restarter_->deaths() : std::vector<ShardRestarter::Death>{};
  }

  // kSteps steps of kWorkers workers, each gathering every layer at the
  // step's version and pushing its synthetic gradient (last layer first,
  // as a backward pass does); then every layer at the last version.
  Weights Train() {
    const client::ShardSet& set = *set_;
    const auto layers = static_cast<uint32_t>(set.model().layers.size());
    std::vector<std::unique_ptr<client::GradientSink>> sinks;
    for (uint32_t w = 0; w < kWorkers; ++w) {
      auto sink = client::GradientSink::Create(
          set, {.worker = w, .chunk_bytes = kChunkBytes, .timeout = kPatience});
      EXPECT_TRUE(sink.ok()) << sink.status();
      if (!sink.ok()) return {};
      sinks.push_back(*std::move(sink));
    }
    for (uint64_t step = 0; step < kSteps; ++step) {
      std::vector<std::shared_future<absl::StatusOr<client::PushResult>>> results;
      for (uint32_t l = layers; l-- > 0;) {
        for (uint32_t w = 0; w < kWorkers; ++w) {
          absl::StatusOr<client::Layer> layer = Gather(l, step);
          EXPECT_TRUE(layer.ok()) << "step " << step << ", layer " << l << ": " << layer.status();
          if (!layer.ok()) return {};
          auto gradient =
              client::LayerBuffer::Allocate(set.view().gradient_layouts[l].total_bytes());
          EXPECT_TRUE(gradient.ok());
          EXPECT_TRUE(tools::FillSyntheticGradient(set.view().gradient_layouts[l], w, step, l,
                                                   {gradient->data(), gradient->size()})
                          .ok());
          auto pushed = sinks[w]->Push(l, step, *std::move(gradient));
          EXPECT_TRUE(pushed.ok()) << pushed.status();
          if (!pushed.ok()) return {};
          results.push_back(*pushed);
        }
      }
      for (auto& sink : sinks) EXPECT_TRUE(sink->Flush().ok());
      for (auto& result : results) {
        EXPECT_TRUE(result.get().ok()) << "step " << step << ": " << result.get().status();
        if (!result.get().ok()) return {};
      }
    }
    Weights weights;
    for (uint32_t l = 0; l < layers; ++l) {
      absl::StatusOr<client::Layer> layer = Gather(l, kSteps);
      EXPECT_TRUE(layer.ok()) << layer.status();
      if (!layer.ok()) return {};
      EXPECT_EQ(layer->version(), kSteps);
      // Tensor by tensor: the padding between them is not the shards'.
      const AssembledLayout& layout = set.view().layouts[l];
      for (const AssembledTensor& tensor : layout.tensors()) {
        const auto bytes = layer->bytes().subspan(tensor.byte_offset, tensor.num_bytes());
        weights.emplace_back(bytes.begin(), bytes.end());
      }
    }
    return weights;
  }

 private:
  absl::StatusOr<client::Layer> Gather(uint32_t layer, uint64_t version) const {
    client::GatherOptions options;
    options.min_version = version;
    options.timeout = kPatience;
    return set_->Gather(layer, options);
  }

  std::string dir_;
  std::unique_ptr<tools::LocalShardSet> processes_;
  std::unique_ptr<client::ShardSet> set_;
  std::optional<ShardRestarter> restarter_;
};

// The same run with no death, once for every scenario.
const Weights& Uninterrupted() {
  static const Weights weights = [] {
    TrainingChaos chaos("");
    Weights weights = chaos.started() ? chaos.Train() : Weights{};
    const absl::Status stopped = chaos.Stop();
    EXPECT_EQ(stopped, absl::OkStatus());
    const std::vector<ShardRestarter::Death> deaths = chaos.deaths();
    EXPECT_TRUE(deaths.empty()) << "shard " << deaths[0].shard << " died, by "
                                << DescribeWaitStatus(deaths[0].wait_status);
    return stopped.ok() && deaths.empty() ? weights : Weights{};
  }();
  return weights;
}

class TrainingChaosTest : public ::testing::TestWithParam<const char*> {};

TEST_P(TrainingChaosTest, AShardKilledMidStepComesBackAndTheRunEndsBitForBit) {
  const Weights& expected = Uninterrupted();
  ASSERT_FALSE(expected.empty()) << "the uninterrupted run failed";
  TrainingChaos chaos(GetParam());
  ASSERT_TRUE(chaos.started());
  const Weights weights = chaos.Train();
  EXPECT_EQ(chaos.Stop(), absl::OkStatus());
  ASSERT_NO_FATAL_FAILURE(ExpectOnlyDeathAt(GetParam(), chaos.fired(), chaos.deaths()));
  ASSERT_EQ(weights.size(), expected.size());
  for (size_t l = 0; l < weights.size(); ++l) {
    ASSERT_EQ(weights[l].size(), expected[l].size());
    EXPECT_EQ(std::memcmp(weights[l].data(), expected[l].data(), weights[l].size()), 0)
        << "tensor " << l << " (in layer order) differs from the uninterrupted run";
  }
}

// Four pushes reach each shard per step (2 layers x 2 workers) and two
// layer steps apply; a checkpoint is written at versions 2, 4 and 6.
INSTANTIATE_TEST_SUITE_P(Deaths, TrainingChaosTest,
                         ::testing::Values(
                             // Step 0, before any checkpoint: the journal holds the run so far.
                             "step.after_push_ack@1:3",
                             // Step 2, after the checkpoint at version 2: acknowledged, then lost
                             // without the journal.
                             "step.after_push_ack@1:11",
                             // Journaled, never answered: the worker's retry finds it taken.
                             "step.after_journal@0:6",
                             // One tensor of a layer stepped, the rest not.
                             "step.mid_apply@1:3",
                             // Shard 0 mid-apply, after a checkpoint.
                             "step.mid_apply@0:6",
                             // Shard 1 in the middle of its second checkpoint
                             // (version 4): it comes back from the first, and
                             // the journal the second would have retired.
                             "checkpoint.mid_write@1:2"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace layercast::testing
