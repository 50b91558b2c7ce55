// Checkpoints that reshard when they load: N = 2 shards train AdamW with
// clipping for 3 steps and stop; M = 3 and M = 1 shards start on copies of
// that directory and train 3 more. Every loss, clip scale, master tensor and
// optimizer buffer equals those of the same 6 steps on N = 2 without a stop,
// bit for bit; and so they do when the 2 shards stopped without a checkpoint
// on the way out, so that the pushes of the step after their last checkpoint
// are only in their journals. And live: 2 shards train 3 steps, freeze,
// and 4 shards fill themselves from them over ShardAdmin and train the last
// 3, bit for bit as well.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/gradient_sink.h"
#include "core/safetensors.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"
#include "tools/synthetic_gradient.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

// fp32 compute: a gathered layer holds the master's values, whose loss the
// run records.
constexpr char kPolicy[] = "p=f32,c=f32";
constexpr char kOptimizer[] =
    "adamw:lr=1e-2,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1,clip=0.5;*norm*:weight_decay=0";
constexpr uint32_t kWorkers = 2;
constexpr uint64_t kSteps = 6;
constexpr uint64_t kStopAfter = 3;
constexpr char kToken[] = "reshard-test-admin-token-0123456789abcdef";

// What a run saw, step by step.
struct Seen {
  // Per step and layer: half the sum of squares of the gathered layer
  // (the loss of a toy objective), as its bits.
  std::vector<uint64_t> losses;
  // Per step: the clip scale, as its bits.
  std::vector<uint32_t> scales;
};

std::vector<std::string> BaseFlags(const std::string& model, const std::string& dir,
                                   const std::string& token) {
  return {"--model",
          model,
          "--policy",
          kPolicy,
          "--optimizer",
          kOptimizer,
          "--data-parallel-workers",
          std::to_string(kWorkers),
          "--checkpoint-dir",
          dir,
          "--chunk-bytes",
          "8192",
          "--admin-token-file",
          token};
}

// Trains steps [from, to) through `set`, both workers pushing every layer;
// false (the test failed) on an error.
bool Train(const client::ShardSet& set, uint64_t from, uint64_t to, Seen& seen) {
  std::vector<std::unique_ptr<client::GradientSink>> sinks;
  for (uint32_t w = 0; w < kWorkers; ++w) {
    auto sink = client::GradientSink::Create(set, {.worker = w, .chunk_bytes = 8192});
    EXPECT_TRUE(sink.ok()) << sink.status();
    if (!sink.ok()) return false;
    sinks.push_back(*std::move(sink));
  }
  const auto layers = static_cast<uint32_t>(set.model().layers.size());
  for (uint64_t step = from; step < to; ++step) {
    for (uint32_t l = 0; l < layers; ++l) {
      client::GatherOptions options;
      options.min_version = step;
      absl::StatusOr<client::Layer> layer = set.Gather(l, options);
      EXPECT_TRUE(layer.ok()) << layer.status();
      if (!layer.ok()) return false;
      EXPECT_EQ(layer->version(), step) << "layer " << l;
      double loss = 0;
      for (size_t t = 0; t < layer->num_tensors(); ++t) {
        const client::Layer::TensorView tensor = layer->tensor(t);
        EXPECT_EQ(tensor.dtype, DType::kFloat32);
        for (uint64_t e = 0; e < tensor.num_elements; ++e) {
          float value = 0;
          std::memcpy(&value, tensor.bytes.data() + e * sizeof(float), sizeof(float));
          loss += 0.5 * static_cast<double>(value) * value;
        }
      }
      seen.losses.push_back(std::bit_cast<uint64_t>(loss));
      for (uint32_t w = 0; w < kWorkers; ++w) {
        absl::StatusOr<client::LayerBuffer> gradient =
            client::LayerBuffer::Allocate(set.view().gradient_layouts[l].total_bytes());
        EXPECT_TRUE(gradient.ok());
        if (!gradient.ok()) return false;
        EXPECT_TRUE(tools::FillSyntheticGradient(set.view().gradient_layouts[l], w, step, l,
                                                 {gradient->data(), gradient->size()})
                        .ok());
        auto pushed = sinks[w]->Push(l, step, *std::move(gradient));
        EXPECT_TRUE(pushed.ok()) << pushed.status();
        if (!pushed.ok()) return false;
        const absl::StatusOr<client::PushResult>& result = pushed->get();
        EXPECT_TRUE(result.ok()) << result.status();
        if (!result.ok()) return false;
      }
    }
    // Worker 0 last: it sends the clip scale.
    for (uint32_t w = kWorkers; w-- > 0;) {
      absl::StatusOr<client::GradientSink::StepEnd> end = sinks[w]->FinishStep(step);
      EXPECT_TRUE(end.ok()) << end.status();
      if (!end.ok()) return false;
      if (w == 0) {
        EXPECT_TRUE(end->clipped);
        seen.scales.push_back(std::bit_cast<uint32_t>(end->scale));
      }
    }
  }
  return true;
}

// Every tensor of the checkpoints `count` shards wrote in `dir`, master and
// optimizer buffers, whole (each file holds its shard's range; in shard
// order they make the tensor), and the training metadata that must agree.
struct Assembled {
  std::map<std::string, std::vector<float>> tensors;
  std::map<std::string, std::string> metadata;
};
Assembled Assemble(const std::string& dir, uint32_t count) {
  Assembled assembled;
  for (uint32_t i = 0; i < count; ++i) {
    const std::string path = absl::StrCat(dir, "/shard-", i, "-of-", count, ".safetensors");
    auto reader = SafetensorsReader::Open(path);
    EXPECT_TRUE(reader.ok()) << reader.status();
    if (!reader.ok()) return assembled;
    for (const SafetensorsTensor& entry : (*reader)->tensors()) {
      EXPECT_EQ(entry.name.rfind("__staged__/", 0), std::string::npos)
          << "no step is open after the last";
      std::vector<float> values(entry.num_elements);
      EXPECT_TRUE((*reader)->ReadF32(entry, {0, entry.num_elements}, values).ok());
      auto& whole = assembled.tensors[entry.name];
      whole.insert(whole.end(), values.begin(), values.end());
    }
    for (const char* key : {"version", "layer_versions", "optimizer_steps", "last_clip",
                            "optimizer", "model_id", "layout_digest"}) {
      const auto it = (*reader)->metadata().find(key);
      EXPECT_NE(it, (*reader)->metadata().end()) << key << " in " << path;
      if (it == (*reader)->metadata().end()) continue;
      if (i == 0) assembled.metadata[key] = it->second;
      EXPECT_EQ(assembled.metadata[key], it->second) << key << " in " << path;
    }
  }
  return assembled;
}

void ExpectSameBits(const Assembled& expected, const Assembled& actual, const std::string& what) {
  EXPECT_EQ(actual.metadata, expected.metadata) << what;
  ASSERT_EQ(actual.tensors.size(), expected.tensors.size()) << what;
  size_t optimizer_buffers = 0;
  for (const auto& [name, values] : expected.tensors) {
    const auto it = actual.tensors.find(name);
    ASSERT_NE(it, actual.tensors.end()) << what << ": " << name;
    ASSERT_EQ(it->second.size(), values.size()) << what << ": " << name;
    EXPECT_EQ(std::memcmp(it->second.data(), values.data(), values.size() * sizeof(float)), 0)
        << what << ": tensor " << name << " differs";
    if (name.rfind("__optimizer__/", 0) == 0) ++optimizer_buffers;
  }
  // exp_avg and exp_avg_sq of every tensor: the state was compared too.
  EXPECT_EQ(optimizer_buffers * 3, expected.tensors.size() * 2) << what;
}

std::string CopyDir(const std::string& from, const std::string& name) {
  const std::string to = MakeTempDir(name);
  for (const auto& entry : std::filesystem::directory_iterator(from)) {
    const std::string file = entry.path().filename().string();
    // A lock is the process's; the copy's shards take their own.
    if (file.ends_with(".lock")) continue;
    std::filesystem::copy_file(entry.path(), to + "/" + file);
  }
  return to;
}

class ReshardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = MakeTempDir("reshard-model");
    model_ = WriteTestModel(dir + "/model.safetensors", 2, 17);
    token_ = WriteAdminToken(MakeTempDir("reshard-token"), kToken);
    // The run without a stop.
    const std::string straight = MakeTempDir("reshard-straight");
    RunningShards shards = StartShards(2, BaseFlags(model_.path, straight, token_));
    ASSERT_NE(shards.set, nullptr);
    ASSERT_TRUE(Train(*shards.set, 0, kSteps, straight_));
    ASSERT_EQ(shards.processes->Stop(), absl::OkStatus());
    expected_ = Assemble(straight, 2);
    ASSERT_EQ(expected_.metadata["version"], absl::StrCat(kSteps));
    // The run must clip for the test to show the clip state carried over.
    EXPECT_NE(straight_.scales.front(), std::bit_cast<uint32_t>(1.0f));
  }

  // Starts `count` shards on `dir`, trains the steps after `from`, stops
  // them (each writes its checkpoint) and checks the whole run against the
  // one without a stop.
  // Returns shard 0's log.
  std::string ResumeAndCompare(const std::string& dir, uint32_t count, uint64_t from, Seen seen,
                               const std::string& what) {
    const std::string logs = MakeTempDir("reshard-logs");
    RunningShards shards = StartShards(count, BaseFlags(model_.path, dir, token_), logs);
    EXPECT_NE(shards.set, nullptr) << what;
    if (shards.set == nullptr) return "";
    EXPECT_TRUE(Train(*shards.set, from, kSteps, seen)) << what;
    EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
    EXPECT_EQ(seen.losses, straight_.losses) << what;
    EXPECT_EQ(seen.scales, straight_.scales) << what;
    ExpectSameBits(expected_, Assemble(dir, count), what);
    std::string log;
    EXPECT_EQ(RunCommand(absl::StrCat("cat ", logs, "/shard-0.log"), &log), 0);
    EXPECT_THAT(log, HasSubstr("loading the checkpoints of 2 shards")) << what;
    return log;
  }

  TestModel model_;
  std::string token_;
  Seen straight_;
  Assembled expected_;
};

TEST_F(ReshardTest, TwoShardsCheckpointThenThreeAndOneTrainOnBitForBit) {
  const std::string dir = MakeTempDir("reshard-stopped");
  Seen before;
  {
    RunningShards shards = StartShards(2, BaseFlags(model_.path, dir, token_));
    ASSERT_NE(shards.set, nullptr);
    ASSERT_TRUE(Train(*shards.set, 0, kStopAfter, before));
    // SIGTERM: each writes its checkpoint at version 3.
    ASSERT_EQ(shards.processes->Stop(), absl::OkStatus());
  }
  for (const uint32_t count : {3u, 1u}) {
    ResumeAndCompare(CopyDir(dir, absl::StrCat("reshard-to-", count)), count, kStopAfter, before,
                     absl::StrCat("2 shards into ", count));
  }
}

TEST_F(ReshardTest, PushesAfterTheCheckpointComeFromTheJournalsResharded) {
  const std::string dir = MakeTempDir("reshard-journal");
  Seen before;
  {
    std::vector<std::string> flags = BaseFlags(model_.path, dir, token_);
    // The step after the checkpoint stays in the journals only.
    flags.insert(flags.end(), {"--checkpoint-on-sigterm", "false"});
    RunningShards shards = StartShards(2, flags);
    ASSERT_NE(shards.set, nullptr);
    ASSERT_TRUE(Train(*shards.set, 0, kStopAfter - 1, before));
    std::string output;
    ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " checkpoint --shards ",
                                      absl::StrJoin(shards.set->addresses(), ","), " --token-file ",
                                      token_, " --insecure"),
                         &output),
              0)
        << output;
    ASSERT_THAT(output, HasSubstr(absl::StrCat("version ", kStopAfter - 1)));
    ASSERT_TRUE(Train(*shards.set, kStopAfter - 1, kStopAfter, before));
    ASSERT_EQ(shards.processes->Stop(), absl::OkStatus());
  }
  const auto journals = [&] {
    int found = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().filename().string().find(".journal-") != std::string::npos) ++found;
    }
    return found;
  };
  ASSERT_GT(journals(), 0) << "the last step's pushes are in the journals";
  for (const uint32_t count : {3u, 1u}) {
    const std::string log = ResumeAndCompare(
        CopyDir(dir, absl::StrCat("reshard-journal-to-", count)), count, kStopAfter, before,
        absl::StrCat("2 shards and their journals into ", count));
    // Every layer's two pushes of the last step, and its clip scale.
    EXPECT_THAT(log, HasSubstr(absl::StrCat("push journals of 2 shards, resharded: ")));
    EXPECT_THAT(
        log, HasSubstr(absl::StrCat(4 * kWorkers + 1, " push(es) and clip scale(s) taken again")))
        << log;
  }
}

// HandOver on every shard at `addresses`, with `at_version` if given: the
// answers, or a failure.
std::vector<layercast::v1::HandOverResponse> HandOver(const std::vector<std::string>& addresses,
                                                      std::optional<uint64_t> at_version,
                                                      grpc::StatusCode expected = grpc::OK) {
  std::vector<layercast::v1::HandOverResponse> answers;
  for (const std::string& address : addresses) {
    auto admin = layercast::v1::ShardAdmin::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    layercast::v1::HandOverRequest request;
    if (at_version) request.set_at_version(*at_version);
    const grpc::Status status = admin->HandOver(&context, request, &answers.emplace_back());
    EXPECT_EQ(status.error_code(), expected) << address << ": " << status.error_message();
  }
  return answers;
}

// Worker 0's (zero) gradient of layer 0 for `step`: what the shard made of
// it, taken or refused.
absl::Status PushLayerZero(client::ShardSet& set, uint64_t step) {
  auto sink = client::GradientSink::Create(set, {.worker = 0, .chunk_bytes = 8192});
  if (!sink.ok()) return sink.status();
  absl::StatusOr<client::LayerBuffer> gradient =
      client::LayerBuffer::Allocate(set.view().gradient_layouts[0].total_bytes());
  if (!gradient.ok()) return gradient.status();
  auto pushed = (*sink)->Push(0, step, *std::move(gradient));
  return pushed.ok() ? pushed->get().status() : pushed.status();
}

TEST_F(ReshardTest, LiveHandOverFromTwoToFourTrainsOnBitForBit) {
  RunningShards old_set =
      StartShards(2, BaseFlags(model_.path, MakeTempDir("handover-old"), token_));
  ASSERT_NE(old_set.set, nullptr);
  const std::string old_addresses = absl::StrJoin(old_set.set->addresses(), ",");
  const std::vector<std::string> new_flags = [&] {
    std::vector<std::string> flags =
        BaseFlags(model_.path, MakeTempDir("handover-refused"), token_);
    flags.insert(flags.end(), {"--hand-over-from", old_addresses, "--peers-insecure", "true"});
    return flags;
  }();
  // Not frozen: the new set refuses to start, naming what to do.
  {
    tools::LocalShardSet::Options options;
    options.shard_binary = ShardBinary();
    options.num_shards = 4;
    options.extra_flags = new_flags;
    options.log_dir = MakeTempDir("handover-refused-logs");
    EXPECT_FALSE(tools::LocalShardSet::Start(options).ok());
    std::string log;
    EXPECT_EQ(RunCommand(absl::StrCat("cat ", options.log_dir, "/shard-0.log"), &log), 0);
    EXPECT_THAT(log, HasSubstr("this shard is not handing over: freeze every shard"));
  }
  Seen seen;
  ASSERT_TRUE(Train(*old_set.set, 0, kStopAfter, seen));
  // Not frozen: its state may still change, so ReadState refuses.
  {
    auto admin = layercast::v1::ShardAdmin::NewStub(
        grpc::CreateChannel(old_set.set->addresses()[0], grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    layercast::v1::ReadStateRequest request;
    request.set_end(1);
    layercast::v1::ReadStateResponse answer;
    const grpc::Status status = admin->ReadState(&context, request, &answer);
    EXPECT_EQ(status.error_code(), grpc::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(), HasSubstr("call HandOver with at_version"));
  }
  // Past version 2 already: that hand-over is refused, freezing nothing.
  HandOver(old_set.set->addresses(), kStopAfter - 1, grpc::FAILED_PRECONDITION);
  // The freeze as an operator runs it: every shard, waited for to its
  // step boundary.
  {
    std::string output;
    ASSERT_EQ(
        RunCommand(absl::StrCat(CliBinary(), " hand-over --shards ", old_addresses,
                                " --token-file ", token_, " --insecure --at-version ", kStopAfter),
                   &output),
        0)
        << output;
    for (const char* shard : {"shard 0/2", "shard 1/2"}) {
      EXPECT_THAT(output, HasSubstr(absl::StrCat(shard, "  frozen at version ", kStopAfter,
                                                 ", at its step boundary")));
    }
  }
  for (const auto& answer : HandOver(old_set.set->addresses(), std::nullopt)) {
    EXPECT_TRUE(answer.at_boundary());
    EXPECT_EQ(answer.frozen_at(), kStopAfter);
  }
  // The frozen set refuses the next step's push, telling the worker where
  // to go, and keeps serving reads.
  {
    const absl::Status refused = PushLayerZero(*old_set.set, kStopAfter);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_THAT(refused.message(), HasSubstr("reconnect to the new set's addresses"));
    client::GatherOptions options;
    options.min_version = kStopAfter;
    absl::StatusOr<client::Layer> layer = old_set.set->Gather(1, options);
    ASSERT_TRUE(layer.ok()) << layer.status();
    EXPECT_EQ(layer->version(), kStopAfter);
  }
  // The workers move: a set of 4 filled from the frozen 2 trains on.
  const std::string new_dir = MakeTempDir("handover-new");
  std::vector<std::string> flags = BaseFlags(model_.path, new_dir, token_);
  flags.insert(flags.end(), {"--hand-over-from", old_addresses, "--peers-insecure", "true"});
  const std::string logs = MakeTempDir("handover-logs");
  RunningShards new_set = StartShards(4, flags, logs);
  ASSERT_NE(new_set.set, nullptr);
  ASSERT_TRUE(Train(*new_set.set, kStopAfter, kSteps, seen));
  // Reads of the old set still answer while the new set trains.
  EXPECT_TRUE(old_set.set->Gather(0, {}).ok());
  ASSERT_EQ(new_set.processes->Stop(), absl::OkStatus());
  EXPECT_EQ(seen.losses, straight_.losses);
  EXPECT_EQ(seen.scales, straight_.scales);
  ExpectSameBits(expected_, Assemble(new_dir, 4), "2 shards handed over to 4");
  std::string log;
  EXPECT_EQ(RunCommand(absl::StrCat("cat ", logs, "/shard-3.log"), &log), 0);
  EXPECT_THAT(log, HasSubstr("filling this shard from the 2 shards of a running set"));
  // Unfreeze (a hand-over abandoned): the old set takes step 3 again.
  {
    std::string output;
    ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " hand-over --shards ", old_addresses,
                                      " --token-file ", token_, " --insecure --unfreeze"),
                         &output),
              0)
        << output;
    EXPECT_THAT(output, HasSubstr("2 shard(s) unfrozen"));
  }
  const absl::Status taken = PushLayerZero(*old_set.set, kStopAfter);
  EXPECT_TRUE(taken.ok()) << taken;
}

}  // namespace
}  // namespace layercast::testing
