// TorchOptimizerState: torch.optim's state by parameter name, as the
// checkpoint a training shard restores: each shard gets its elements of
// every buffer and every layer's step; a file that does not fit the model
// or --optimizer is refused, naming what does not.

#include "server/training/torch_optimizer_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "core/layout.h"
#include "server/checkpoints/checkpoint_format.h"
#include "tests/server/checkpoints/checkpoint_test_util.h"

namespace layercast::server::testing {
namespace {

using ::testing::HasSubstr;

// Two layers: "a" [5, 3] and "b" [2] (fewer elements than shards), then "c" [7].
class TinySource final : public ParameterSource {
 public:
  TinySource() {
    model_.model_id = "tiny";
    model_.layers = {{"l0", {{"a", {5, 3}, 15}, {"b", {2}, 2}}}, {"l1", {{"c", {7}, 7}}}};
  }
  const ModelSpec& model() const override { return model_; }
  absl::Status Read(uint32_t, uint32_t, ElementRange, std::span<float> dst) const override {
    std::fill(dst.begin(), dst.end(), 1.0f);
    return absl::OkStatus();
  }

 private:
  ModelSpec model_;
};

// Element k of buffer `buffer` of tensor number `t`: distinct everywhere.
float Value(int t, const std::string& buffer, uint64_t k) {
  return static_cast<float>(t * 1000 + k) * (buffer == "exp_avg" ? 1.0f : -1.0f);
}

struct FileTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<float> values;  // written as F32, or truncated to BF16
};

// AdamW's state of TinySource's tensors at steps 3 (l0) and 4 (l1), which
// `edit` may change before it is written.
std::string WriteState(
    const std::string& dir, const std::string& optimizer,
    const std::function<void(std::vector<FileTensor>&, std::map<std::string, std::string>&)>& edit =
        nullptr) {
  std::vector<FileTensor> tensors;
  const TinySource source;
  int t = 0;
  for (const LayerSpec& layer : source.model().layers) {
    for (const TensorSpec& tensor : layer.tensors) {
      for (const std::string buffer : {"exp_avg", "exp_avg_sq"}) {
        FileTensor& file = tensors.emplace_back();
        file.name = absl::StrCat("state.", tensor.name, ".", buffer);
        file.shape = tensor.shape;
        for (uint64_t k = 0; k < tensor.num_elements; ++k)
          file.values.push_back(Value(t, buffer, k));
      }
      tensors.push_back({absl::StrCat("state.", tensor.name, ".step"),
                         DType::kFloat32,
                         {},
                         {layer.name == "l0" ? 3.0f : 4.0f}});
      ++t;
    }
  }
  std::map<std::string, std::string> metadata = {{"format", "torch-optimizer-state"},
                                                 {"optimizer", optimizer}};
  if (edit) edit(tensors, metadata);
  std::vector<SafetensorsWriter::TensorHeader> headers;
  for (const FileTensor& tensor : tensors) {
    headers.push_back({tensor.name, tensor.dtype, tensor.shape});
  }
  const std::string path = absl::StrCat(FreshDir(dir), "/optimizer.safetensors");
  auto writer = SafetensorsWriter::Create(path, headers, metadata);
  EXPECT_TRUE(writer.ok()) << writer.status();
  for (const FileTensor& tensor : tensors) {
    std::vector<uint8_t> bytes;
    for (const float value : tensor.values) {
      uint32_t bits;
      std::memcpy(&bits, &value, 4);
      for (int i = 0; i < (tensor.dtype == DType::kBFloat16 ? 2 : 4); ++i) {
        bytes.push_back(
            static_cast<uint8_t>(bits >> (8 * (i + (tensor.dtype == DType::kBFloat16 ? 2 : 0)))));
      }
    }
    EXPECT_TRUE((*writer)->Append(bytes).ok());
  }
  EXPECT_TRUE((*writer)->Finish().ok());
  return path;
}

absl::StatusOr<std::unique_ptr<TorchOptimizerState>> Open(const std::string& path,
                                                          const std::string& spec,
                                                          uint32_t shard = 0,
                                                          uint32_t num_shards = 3) {
  return TorchOptimizerState::Open(path, std::make_unique<TinySource>(),
                                   *OptimizerSpec::Parse(spec), shard, num_shards);
}

constexpr char kSpec[] = "adamw:lr=0.001,weight_decay=0.1;b:weight_decay=0";

TEST(TorchOptimizerStateTest, EachShardGetsItsElementsAndEveryLayersStep) {
  // The shard's lr may differ: its schedule is its own.
  const std::string path =
      WriteState("torch_state_ranges", "adamw:lr=0.5,weight_decay=0.1;b:weight_decay=0");
  for (uint32_t shard = 0; shard < 3; ++shard) {
    auto state = Open(path, kSpec, shard);
    ASSERT_TRUE(state.ok()) << state.status();
    ASSERT_TRUE((*state)->training());
    EXPECT_EQ((*state)->training()->layer_versions, (std::vector<uint64_t>{3, 4}));
    EXPECT_EQ((*state)->training()->optimizer_steps, (std::vector<uint64_t>{3, 4}));
    EXPECT_EQ((*state)->version(), 3u);
    int t = 0;
    for (const auto& [name, elements] :
         std::vector<std::pair<std::string, uint64_t>>{{"a", 15}, {"b", 2}, {"c", 7}}) {
      const ElementRange owned = ShardElementRange(elements, shard, 3);
      for (const std::string buffer : {"exp_avg", "exp_avg_sq"}) {
        std::vector<float> values = {42.0f};
        ASSERT_TRUE((*state)->ReadState(OptimizerStateName(buffer, name), values).ok());
        std::vector<float> want;
        for (uint64_t k = owned.begin; k < owned.end; ++k) want.push_back(Value(t, buffer, k));
        EXPECT_EQ(values, want) << name << " " << buffer << " shard " << shard;
      }
      ++t;
    }
    std::vector<float> none;
    EXPECT_TRUE(absl::IsNotFound((*state)->ReadState(StagedPushName(0, "0"), none)));
  }
}

struct Refusal {
  std::string name;
  std::string spec;  // the shard's --optimizer
  std::function<void(std::vector<FileTensor>&, std::map<std::string, std::string>&)> edit;
  std::string says;
};

TEST(TorchOptimizerStateTest, RefusesWhatDoesNotFitWithOneLine) {
  const auto find = [](std::vector<FileTensor>& tensors, const std::string& name) -> FileTensor& {
    return *std::find_if(tensors.begin(), tensors.end(),
                         [&](const FileTensor& t) { return t.name == name; });
  };
  const std::vector<Refusal> refusals = {
      {"another kind", "sgd:lr=0.1,momentum=0.9", nullptr,
       "it holds adamw state, but --optimizer is sgd"},
      {"other betas", "adamw:lr=0.001,weight_decay=0.1,beta2=0.95;b:weight_decay=0", nullptr,
       "parameter a has beta2 0.999 there, 0.95 in --optimizer"},
      {"another group's weight decay", "adamw:lr=0.001,weight_decay=0.1", nullptr,
       "parameter b has weight_decay 0 there, 0.1 in --optimizer"},
      {"no format", kSpec, [](auto&, auto& metadata) { metadata.erase("format"); },
       "not an optimizer state"},
      {"a missing buffer", kSpec,
       [&](auto& tensors, auto&) {
         std::erase_if(tensors, [](auto& t) { return t.name == "state.c.exp_avg_sq"; });
       },
       "no state.c.exp_avg_sq"},
      {"no step", kSpec,
       [&](auto& tensors, auto&) {
         std::erase_if(tensors, [](auto& t) { return t.name == "state.a.step"; });
       },
       "no state.a.step: AdamW's bias correction needs every parameter's step"},
      {"another shape", kSpec,
       [&](auto& tensors, auto&) {
         find(tensors, "state.a.exp_avg").shape = {3, 5};
       },
       "state.a.exp_avg is float32 [3, 5], but the parameter is float32 [5, 3]"},
      {"bfloat16", kSpec,
       [&](auto& tensors, auto&) { find(tensors, "state.c.exp_avg").dtype = DType::kBFloat16; },
       "state.c.exp_avg is bfloat16 [7], but the parameter is float32 [7]"},
      {"a fractional step", kSpec,
       [&](auto& tensors, auto&) { find(tensors, "state.c.step").values = {2.5f}; },
       "state.c.step is 2.5, not a step count"},
      {"one layer at two steps", kSpec,
       [&](auto& tensors, auto&) { find(tensors, "state.b.step").values = {2.0f}; },
       "a is at step 3 and b at step 2, in one layer (l0)"},
      {"a tensor the model lacks", kSpec,
       [](auto& tensors, auto&) {
         tensors.push_back({"state.d.exp_avg", DType::kFloat32, {1}, {0}});
       },
       "it holds state.d.exp_avg, which names no state of a parameter of model tiny"},
  };
  int i = 0;
  for (const Refusal& refusal : refusals) {
    SCOPED_TRACE(refusal.name);
    const std::string path =
        WriteState(absl::StrCat("torch_state_refusal_", i++),
                   "adamw:lr=0.5,weight_decay=0.1;b:weight_decay=0", refusal.edit);
    auto state = Open(path, refusal.spec);
    ASSERT_FALSE(state.ok());
    EXPECT_TRUE(absl::IsFailedPrecondition(state.status())) << state.status();
    EXPECT_THAT(state.status().message(),
                HasSubstr(absl::StrCat("--optimizer-state ", path, ": ")));
    EXPECT_THAT(state.status().message(), HasSubstr(refusal.says));
    EXPECT_EQ(std::string(state.status().message()).find('\n'), std::string::npos);
  }
}

}  // namespace
}  // namespace layercast::server::testing
