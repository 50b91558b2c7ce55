// Training through real shard processes matches plain PyTorch bit for bit:
// N = 3 shards, W = 2 workers, 20 steps of AdamW (weight decay with a
// per-tensor override, linear warm-up then cosine decay to a floor) and of
// SGD with Nesterov momentum, synthetic deterministic gradients pushed in
// each tensor's compute dtype (bf16, norms in fp32). The fp32 master the
// shards write to their checkpoints on SIGTERM is compared with
// torch.optim's by training_torch_test.py, which recomputes everything from
// the initial values. Pushing the workers in reverse order gives the same
// bits, and so does a run in which a shard is SIGKILLed between two steps
// and restarted from the checkpoint it wrote just before, optimizer state
// included.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <future>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/gradient_sink.h"
#include "core/optimizer_spec.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"
#include "tests/prerequisite.h"
#include "tools/synthetic_gradient.h"

namespace layercast::testing {
namespace {

constexpr char kPython[] = "/usr/bin/python3";
constexpr char kPolicy[] = "p=f32,c=bf16;*norm*=f32";
constexpr uint32_t kShards = 3;
constexpr uint32_t kWorkers = 2;
constexpr uint64_t kSteps = 20;

bool TorchAvailable() {
  return std::system(absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1").c_str()) == 0;
}

struct Recipe {
  std::string name;
  std::string optimizer;
  bool reverse_workers = false;  // worker 1's push of each layer lands first
  // Between this step and the next, every shard checkpoints (layercast
  // checkpoint), then shard 1 is SIGKILLed and restarted from its
  // checkpoint; 0: never.
  uint64_t kill_after_step = 0;
  bool clipped = false;  // the spec has clip=
};

constexpr char kToken[] = "training-torch-test-token-0123456789";

std::string WriteToken(const std::string& dir) { return WriteAdminToken(dir, kToken); }

// Trains through a fresh shard set; returns the checkpoint directory.
std::string Train(const Recipe& recipe, const TestModel& model) {
  const std::string checkpoints = MakeTempDir("training-torch-" + recipe.name);
  const std::string token = WriteToken(MakeTempDir("training-torch-token-" + recipe.name));
  RunningShards shards = StartShards(
      kShards, {"--model", model.path, "--policy", kPolicy, "--optimizer", recipe.optimizer,
                "--data-parallel-workers", std::to_string(kWorkers), "--checkpoint-dir",
                checkpoints, "--chunk-bytes", "8192", "--admin-token-file", token});
  EXPECT_NE(shards.set, nullptr);
  if (shards.set == nullptr) return "";
  const client::ShardSet& set = *shards.set;
  std::vector<std::unique_ptr<client::GradientSink>> sinks;
  for (uint32_t w = 0; w < kWorkers; ++w) {
    sinks.push_back(*client::GradientSink::Create(set, {.worker = w, .chunk_bytes = 8192}));
  }
  const auto layers = static_cast<uint32_t>(set.model().layers.size());
  for (uint64_t step = 0; step < kSteps; ++step) {
    for (uint32_t l = layers; l-- > 0;) {
      for (uint32_t i = 0; i < kWorkers; ++i) {
        const uint32_t w = recipe.reverse_workers ? kWorkers - 1 - i : i;
        client::GatherOptions options;
        options.min_version = step;
        absl::StatusOr<client::Layer> layer = set.Gather(l, options);
        EXPECT_TRUE(layer.ok()) << layer.status();
        if (!layer.ok()) return "";
        EXPECT_EQ(layer->version(), step) << "layer " << l;
        absl::StatusOr<client::LayerBuffer> gradient =
            client::LayerBuffer::Allocate(set.view().gradient_layouts[l].total_bytes());
        EXPECT_TRUE(gradient.ok());
        EXPECT_TRUE(tools::FillSyntheticGradient(set.view().gradient_layouts[l], w, step, l,
                                                 {gradient->data(), gradient->size()})
                        .ok());
        auto pushed = sinks[w]->Push(l, step, *std::move(gradient));
        EXPECT_TRUE(pushed.ok()) << pushed.status();
        // Each push lands before the next worker's: the arrival order is
        // the recipe's.
        const absl::StatusOr<client::PushResult>& result = pushed->get();
        EXPECT_TRUE(result.ok()) << result.status();
        if (!result.ok()) return "";
        // A clipped step applies only once worker 0 sends the scale.
        EXPECT_EQ(result->applied, !recipe.clipped && i == kWorkers - 1);
      }
    }
    // Worker 0 last: with clipping it completes the step for everyone.
    for (uint32_t w = kWorkers; w-- > 0;) {
      absl::StatusOr<client::GradientSink::StepEnd> end = sinks[w]->FinishStep(step);
      EXPECT_TRUE(end.ok()) << end.status();
      if (!end.ok()) return "";
      EXPECT_EQ(end->clipped, recipe.clipped && w == 0);
      if (end->clipped) {
        EXPECT_LT(end->scale, 1.0f) << "the recipe's gradients must be clipped";
      }
    }
    if (step + 1 == recipe.kill_after_step) {
      std::string output;
      EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(), " checkpoint --shards ",
                                        absl::StrJoin(set.addresses(), ","), " --token-file ",
                                        token, " --insecure"),
                           &output),
                0)
          << output;
      EXPECT_THAT(output, ::testing::HasSubstr(absl::StrCat("version ", step + 1)));
      // A crash: no checkpoint on the way out. The restarted shard resumes
      // from the one just written, optimizer state included.
      shards.processes->KillForTest(1);
      EXPECT_TRUE(shards.processes->RestartForTest(1).ok());
    }
  }
  // SIGTERM: every shard writes its fp32 master to its checkpoint.
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
  return checkpoints;
}

// What training_torch_test.py needs: the model's tensors with their layer,
// index within the layer, compute dtype and hyper-parameters, and their
// initial values (raw fp32 in the same order, in a file beside).
void WriteDescription(const std::string& path, const client::ShardSet& view_of,
                      const TestModel& model, const std::vector<Recipe>& recipes,
                      const std::vector<std::string>& checkpoint_dirs) {
  nlohmann::json description;
  description["steps"] = kSteps;
  description["workers"] = kWorkers;
  description["num_shards"] = kShards;
  std::ofstream initial(path + ".f32", std::ios::binary);
  const wire::ShardSetView& view = view_of.view();
  for (uint32_t l = 0; l < view.model.layers.size(); ++l) {
    for (uint32_t t = 0; t < view.model.layers[l].tensors.size(); ++t) {
      const TensorSpec& tensor = view.model.layers[l].tensors[t];
      const std::vector<float>& values = model.values.at(tensor.name);
      initial.write(reinterpret_cast<const char*>(values.data()),
                    static_cast<std::streamsize>(values.size() * sizeof(float)));
      nlohmann::json entry;
      entry["name"] = tensor.name;
      entry["layer"] = l;
      entry["index"] = t;
      entry["elements"] = tensor.num_elements;
      entry["compute_dtype"] = std::string(DTypeName(view.layouts[l].tensors()[t].compute_dtype));
      description["tensors"].push_back(entry);
    }
  }
  for (size_t r = 0; r < recipes.size(); ++r) {
    const OptimizerSpec spec = *OptimizerSpec::Parse(recipes[r].optimizer);
    nlohmann::json recipe = {{"name", recipes[r].name},
                             {"kind", std::string(OptimizerKindName(spec.kind()))},
                             {"checkpoint_dir", checkpoint_dirs[r]},
                             {"spec", recipes[r].optimizer}};
    for (const auto& tensor : description["tensors"]) {
      const OptimizerHyper hyper = spec.HyperFor(tensor["name"].get<std::string>());
      recipe["hyper"].push_back({{"lr", hyper.lr},
                                 {"weight_decay", hyper.weight_decay},
                                 {"momentum", hyper.momentum},
                                 {"nesterov", hyper.nesterov},
                                 {"beta1", hyper.beta1},
                                 {"beta2", hyper.beta2},
                                 {"eps", hyper.eps}});
    }
    description["recipes"].push_back(recipe);
  }
  std::ofstream(path) << description.dump(1);
}

TEST(TrainingTorchTest, ThreeShardsTwoWorkersMatchTorchBitForBit) {
  if (!TorchAvailable()) {
    LAYERCAST_PREREQUISITE_MISSING(
        absl::StrCat(kPython,
                     " cannot import torch (apt install python3-torch): no training run against "
                     "PyTorch's"));
  }
  const std::string dir = MakeTempDir("training-torch");
  const TestModel model = WriteTestModel(dir + "/model.safetensors", 2, 11);
  const std::string adamw =
      "adamw:lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1,warmup_steps=5,"
      "decay_steps=12,min_lr=1e-4;*norm*:weight_decay=0";
  const std::string adamw_clipped =
      "adamw:lr=1e-3,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1,warmup_steps=5,"
      "decay_steps=12,min_lr=1e-4,clip=1.0;*norm*:weight_decay=0";
  const std::vector<Recipe> recipes = {
      {"adamw", adamw, false},
      {"adamw-reversed", adamw, true},
      {"sgd", "sgd:lr=0.05,momentum=0.9,nesterov=true,weight_decay=0.01;*norm*:weight_decay=0"},
      {"adamw-shard-1-killed-after-step-10", adamw, false, 10},
      {"adamw-clipped", adamw_clipped, false, 0, true},
      {"sgd-clipped-reversed",
       "sgd:lr=0.05,momentum=0.9,weight_decay=0.01,clip=0.5;*norm*:weight_decay=0", true, 0, true},
  };
  std::vector<std::string> checkpoint_dirs;
  for (const Recipe& recipe : recipes) {
    checkpoint_dirs.push_back(Train(recipe, model));
    ASSERT_FALSE(checkpoint_dirs.back().empty()) << recipe.name;
  }
  // A read-only shard set of the same model, for its view.
  RunningShards reader = StartShards(1, {"--model", model.path, "--policy", kPolicy});
  ASSERT_NE(reader.set, nullptr);
  const std::string description = dir + "/training.json";
  WriteDescription(description, *reader.set, model, recipes, checkpoint_dirs);
  std::string output;
  const int status =
      RunCommand(absl::StrCat(kPython, " ", LAYERCAST_SOURCE_DIR,
                              "/tests/integration/training_torch_test.py ", description),
                 &output);
  EXPECT_EQ(status, 0) << output;
  std::printf("%s", output.c_str());
}

}  // namespace
}  // namespace layercast::testing
