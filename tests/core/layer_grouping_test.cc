#include "core/layer_grouping.h"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace layercast {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TensorSpec Tensor(std::string name, std::vector<int64_t> shape = {2, 3}) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return TensorSpec{std::move(name), std::move(shape), n};
}

std::vector<std::string> LayerNames(const ModelSpec& model) {
  std::vector<std::string> names;
  for (const LayerSpec& layer : model.layers) names.push_back(layer.name);
  return names;
}

std::vector<std::string> TensorNames(const LayerSpec& layer) {
  std::vector<std::string> names;
  for (const TensorSpec& tensor : layer.tensors) names.push_back(tensor.name);
  return names;
}

TEST(LayerGroupingTest, DefaultRuleFollowsHuggingFaceConvention) {
  absl::StatusOr<ModelSpec> model = GroupIntoLayers(
      "llama",
      {Tensor("model.layers.10.mlp.up_proj.weight"), Tensor("lm_head.weight"),
       Tensor("model.layers.2.self_attn.q_proj.weight"), Tensor("model.norm.weight"),
       Tensor("model.layers.2.input_layernorm.weight", {3}), Tensor("model.embed_tokens.weight"),
       Tensor("model.layers.0.mlp.down_proj.weight")});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->model_id, "llama");
  // Numeric, not lexicographic: 2 before 10.
  EXPECT_THAT(LayerNames(*model), ElementsAre("model.embed_tokens", "model.layers.0",
                                              "model.layers.2", "model.layers.10", "final"));
  EXPECT_THAT(TensorNames(model->layers[2]), ElementsAre("model.layers.2.input_layernorm.weight",
                                                         "model.layers.2.self_attn.q_proj.weight"));
  EXPECT_THAT(TensorNames(model->layers[4]), ElementsAre("lm_head.weight", "model.norm.weight"));
  EXPECT_EQ(model->layers[2].tensors[0].shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(model->layers[2].tensors[0].num_elements, 3u);
}

TEST(LayerGroupingTest, OmitsEmptyGroups) {
  absl::StatusOr<ModelSpec> model =
      GroupIntoLayers("m", {Tensor("model.layers.1.w"), Tensor("model.layers.0.w")});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_THAT(LayerNames(*model), ElementsAre("model.layers.0", "model.layers.1"));

  model = GroupIntoLayers("m", {Tensor("a"), Tensor("b")});
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_THAT(LayerNames(*model), ElementsAre("final"));
}

TEST(LayerGroupingTest, CustomRule) {
  LayerGroupingRule gpt2;
  gpt2.first_prefix = "transformer.wte.";
  gpt2.layer_regex = R"(^transformer\.h\.(\d+)\.)";
  gpt2.last_name = "head";
  absl::StatusOr<ModelSpec> model = GroupIntoLayers(
      "gpt2",
      {Tensor("transformer.h.1.attn.c_attn.weight"), Tensor("transformer.ln_f.weight"),
       Tensor("transformer.wte.weight"), Tensor("transformer.h.0.mlp.c_fc.weight")},
      gpt2);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_THAT(LayerNames(*model),
              ElementsAre("transformer.wte", "transformer.h.0", "transformer.h.1", "head"));
}

TEST(LayerGroupingTest, EmptyFirstPrefixMeansNoFirstLayer) {
  LayerGroupingRule rule;
  rule.first_prefix = "";
  absl::StatusOr<ModelSpec> model =
      GroupIntoLayers("m", {Tensor("model.embed_tokens.weight"), Tensor("model.layers.0.w")}, rule);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_THAT(LayerNames(*model), ElementsAre("model.layers.0", "final"));
}

void ExpectInvalid(const absl::StatusOr<ModelSpec>& model, const std::string& problem) {
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << model.status();
  EXPECT_THAT(std::string(model.status().message()), HasSubstr(problem));
}

TEST(LayerGroupingTest, RejectsRegexThatDoesNotCompile) {
  LayerGroupingRule rule;
  rule.layer_regex = "^model\\.layers\\.(\\d+";
  ExpectInvalid(GroupIntoLayers("m", {Tensor("a")}, rule), "does not compile");
}

TEST(LayerGroupingTest, RejectsRegexWithoutExactlyOneCaptureGroup) {
  LayerGroupingRule rule;
  rule.layer_regex = R"(^model\.layers\.\d+\.)";
  ExpectInvalid(GroupIntoLayers("m", {Tensor("a")}, rule), "has 0 capture groups");
  rule.layer_regex = R"(^(model)\.layers\.(\d+)\.)";
  ExpectInvalid(GroupIntoLayers("m", {Tensor("a")}, rule), "has 2 capture groups");
}

TEST(LayerGroupingTest, AnOptionalGroupThatTookNoPartNamesNoLayer) {
  LayerGroupingRule rule;
  rule.first_prefix = "embed.";
  rule.layer_regex = R"(^(?:blocks\.(\d+)\.)?)";
  absl::StatusOr<ModelSpec> model = GroupIntoLayers(
      "m", {Tensor("blocks.1.w"), Tensor("head.w"), Tensor("embed.w"), Tensor("blocks.0.w")}, rule);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_THAT(LayerNames(*model), ElementsAre("embed", "blocks.0", "blocks.1", "final"));
}

TEST(LayerGroupingTest, RejectsCaptureThatIsNotAnIndex) {
  LayerGroupingRule rule;
  rule.layer_regex = R"(^model\.layers\.(\w+)\.)";
  ExpectInvalid(GroupIntoLayers("m", {Tensor("model.layers.x.w")}, rule),
                "captured 'x' from tensor 'model.layers.x.w'");
}

TEST(LayerGroupingTest, RejectsIndexSpelledTwoWays) {
  ExpectInvalid(GroupIntoLayers("m", {Tensor("model.layers.3.a"), Tensor("model.layers.03.b")}),
                "layer index 3 is spelled both");
}

TEST(LayerGroupingTest, RejectsNoTensors) { ExpectInvalid(GroupIntoLayers("m", {}), "no tensors"); }

TEST(LayerGroupingTest, RejectsDuplicateTensor) {
  ExpectInvalid(GroupIntoLayers("m", {Tensor("a"), Tensor("a")}), "tensor 'a' appears twice");
}

TEST(LayerGroupingTest, RejectsInconsistentShapes) {
  ExpectInvalid(GroupIntoLayers("m", {TensorSpec{"a", {2, 3}, 5}}), "num_elements 5");
  ExpectInvalid(GroupIntoLayers("m", {TensorSpec{"a", {-2, 3}, 6}}), "negative dimension -2");
}

TEST(LayerGroupingTest, RejectsLayerNameCollision) {
  LayerGroupingRule rule;
  rule.last_name = "model.embed_tokens";
  ExpectInvalid(
      GroupIntoLayers("m", {Tensor("model.embed_tokens.weight"), Tensor("lm_head")}, rule),
      "both named 'model.embed_tokens'");
}

TEST(LayerGroupingTest, FromSafetensors) {
  const std::string dir =
      ::testing::TempDir() + "/layercast_layer_grouping_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  const std::vector<SafetensorsWriter::TensorHeader> headers = {
      {"model.layers.0.w", DType::kFloat32, {2}},
      {"model.embed_tokens.weight", DType::kBFloat16, {2, 2}},
      {"model.norm.weight", DType::kFloat32, {}}};
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, headers, {});
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::vector<uint8_t> zeros(8 + 8 + 4);
  ASSERT_TRUE((*writer)->Append(zeros).ok());
  ASSERT_TRUE((*writer)->Finish().ok());

  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  absl::StatusOr<ModelSpec> model = ModelSpecFromSafetensors(**reader, "tiny");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->model_id, "tiny");
  EXPECT_THAT(LayerNames(*model), ElementsAre("model.embed_tokens", "model.layers.0", "final"));
  EXPECT_EQ(model->layers[0].tensors[0].num_elements, 4u);
  EXPECT_EQ(model->layers[2].tensors[0].num_elements, 1u);  // a scalar
  EXPECT_EQ(TotalElements(*model), 7u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace layercast
