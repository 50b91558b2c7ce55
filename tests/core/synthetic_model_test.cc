#include "core/synthetic_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

namespace layercast {
namespace {

using ::testing::HasSubstr;

TEST(SyntheticModelTest, LlamaShapes) {
  auto model = SyntheticModel::Create("llama:layers=3,hidden=64,ffn=172,vocab=100,seed=5");
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelSpec& spec = (*model)->model();
  EXPECT_EQ(spec.model_id, "synthetic:llama:layers=3,hidden=64,ffn=172,vocab=100,seed=5");
  ASSERT_EQ(spec.layers.size(), 5u);
  EXPECT_EQ(spec.layers[0].tensors[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(spec.layers[0].tensors[0].shape, (std::vector<int64_t>{100, 64}));
  EXPECT_EQ(spec.layers[2].name, "model.layers.1");
  EXPECT_EQ(spec.layers[2].tensors.size(), 9u);
  EXPECT_EQ(spec.layers[4].name, "final");
  const uint64_t per_layer = 2 * 64 + 4 * 64 * 64 + 3 * 64 * 172;
  EXPECT_EQ(TotalElements(spec), 2 * 100 * 64 + 64 + 3 * per_layer);
}

// kv= sizes k_proj and v_proj as grouped-query attention does: a synthetic
// "70B" has Llama-2-70B's 68.98 G parameters, not 78.37 G.
TEST(SyntheticModelTest, KvSetsTheKeyAndValueProjections) {
  auto model = SyntheticModel::Create("llama:layers=80,hidden=8192,ffn=28672,vocab=32000,kv=1024");
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelSpec& spec = (*model)->model();
  EXPECT_EQ(spec.model_id,
            "synthetic:llama:layers=80,hidden=8192,ffn=28672,vocab=32000,kv=1024,seed=0");
  EXPECT_EQ(spec.layers[1].tensors[5].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(spec.layers[1].tensors[5].shape, (std::vector<int64_t>{1024, 8192}));
  EXPECT_EQ(spec.layers[1].tensors[8].shape, (std::vector<int64_t>{1024, 8192}));
  EXPECT_EQ(TotalElements(spec), uint64_t{68976648192});
}

TEST(SyntheticModelTest, AnyRangeMatchesTheElementFunction) {
  auto model = SyntheticModel::Create("llama:layers=1,hidden=32,ffn=48,vocab=16,seed=9");
  ASSERT_TRUE(model.ok());
  const ModelSpec& spec = (*model)->model();
  for (uint32_t l = 0; l < spec.layers.size(); ++l) {
    for (uint32_t t = 0; t < spec.layers[l].tensors.size(); ++t) {
      const TensorSpec& tensor = spec.layers[l].tensors[t];
      const ElementRange range{tensor.num_elements / 3, tensor.num_elements};
      std::vector<float> values(range.size());
      ASSERT_TRUE((*model)->Read(l, t, range, values).ok());
      for (uint64_t i = 0; i < range.size(); ++i) {
        ASSERT_EQ(values[i], SyntheticModel::Value(9, tensor.name, range.begin + i));
        ASSERT_TRUE(std::isfinite(values[i]));
      }
    }
  }
  EXPECT_NE(SyntheticModel::Value(1, "a", 0), SyntheticModel::Value(2, "a", 0));
  EXPECT_NE(SyntheticModel::Value(1, "a", 0), SyntheticModel::Value(1, "b", 0));
  EXPECT_NEAR(SyntheticModel::Value(1, "model.norm.weight", 3), 1.0f, 0.11f);
}

TEST(SyntheticModelTest, RefusesBadSpecs) {
  for (const char* spec : {"gpt:layers=1", "llama:layers=0", "llama:depth=3", "llama:hidden=x",
                           "llama:layers", "llama:hidden=99999999"}) {
    auto model = SyntheticModel::Create(spec);
    ASSERT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_THAT(model.status().message(), HasSubstr(spec));
  }
  EXPECT_TRUE(SyntheticModel::Create("llama:").ok());
}

TEST(SyntheticModelTest, RefusesAModelTooLargeToCount) {
  // Every value within 1..2^20, but about 3.2e19 bytes of fp32 in all: refused
  // with the figure, before a million layers are built.
  const char* spec = "llama:layers=1048576,hidden=1048576,ffn=1048576";
  auto model = SyntheticModel::Create(spec);
  ASSERT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(model.status().message(),
              HasSubstr("synthetic spec 'llama:layers=1048576,hidden=1048576,ffn=1048576' "
                        "describes about 8.07045e+18 elements, 3.22818e+19 bytes of fp32 master, "
                        "more than a 64-bit size can count"));
  // A single value past the cap names that value.
  model = SyntheticModel::Create("llama:hidden=1099511627776");
  ASSERT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(model.status().message(), HasSubstr("not '1099511627776'"));
}

}  // namespace
}  // namespace layercast
