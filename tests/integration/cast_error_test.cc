// A policy's max_rel_error against real shard processes: a layer whose cast
// loses more than the bound is refused, naming the layer and the figure;
// every other layer is served as usual.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "core/cast_error.h"
#include "core/policy.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

// The largest relative error of any tensor of `layer` cast under `policy`.
float LayerMaxRelativeError(const TestModel& model, const LayerSpec& layer, const Policy& policy) {
  float max = 0;
  for (const TensorSpec& tensor : layer.tensors) {
    const std::vector<float>& values = model.values.at(tensor.name);
    const DType dtype = policy.ComputeDTypeFor(tensor.name);
    std::vector<uint8_t> out(values.size() * DTypeSize(dtype));
    CastError error;
    EXPECT_TRUE(
        CastFromF32(values.data(), out.data(), values.size(), dtype, policy.overflow(), &error)
            .ok());
    max = std::max(max, error.max_relative_error);
  }
  return max;
}

TEST(CastErrorBoundTest, ALayerOverTheBoundIsRefusedAndTheRestServed) {
  // The test model's fp32 tensors hold subnormals (bf16 keeps few of their
  // bits) besides ties and large values: a bound of 2^-8 lets bf16's
  // rounding of normal values through and stops the subnormals. Layer 1 is
  // kept in float32, so it loses nothing.
  const std::string policy_text =
      "p=f32,c=bf16,max_rel_error=0.00390625;*norm*=f32;model.layers.1.*=f32";
  const Policy policy = *Policy::Parse(policy_text);
  const TestModel model = WriteTestModel(MakeTempDir("model") + "/model.safetensors", 3, 42);
  RunningShards shards = StartShards(2, {"--model", model.path, "--policy", policy_text});
  ASSERT_NE(shards.set, nullptr);
  const ModelSpec& spec = shards.set->model();
  int refused = 0, served = 0;
  for (uint32_t l = 0; l < spec.layers.size(); ++l) {
    SCOPED_TRACE(spec.layers[l].name);
    const float max = LayerMaxRelativeError(model, spec.layers[l], policy);
    absl::StatusOr<client::Layer> layer = shards.set->Gather(l);
    if (max > *policy.max_rel_error()) {
      ++refused;
      ASSERT_FALSE(layer.ok());
      EXPECT_EQ(layer.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(std::string(layer.status().message()),
                  HasSubstr(absl::StrCat("layer ", l, " (", spec.layers[l].name,
                                         ") loses too much in its cast to bfloat16")));
      EXPECT_THAT(std::string(layer.status().message()),
                  HasSubstr("beyond the policy's max_rel_error=0.00391"));
    } else {
      ++served;
      EXPECT_TRUE(layer.ok()) << layer.status() << " (its largest relative error is " << max << ")";
    }
  }
  EXPECT_GT(refused, 0) << "the model has layers over the bound";
  EXPECT_GT(served, 0) << "and layers within it";
  EXPECT_TRUE(shards.processes->Stop().ok());
}

TEST(CastErrorBoundTest, WithoutABoundEveryLayerIsServed) {
  const TestModel model = WriteTestModel(MakeTempDir("model") + "/model.safetensors", 2, 42);
  RunningShards shards = StartShards(2, {"--model", model.path, "--policy", "p=f32,c=bf16"});
  ASSERT_NE(shards.set, nullptr);
  for (uint32_t l = 0; l < shards.set->model().layers.size(); ++l) {
    EXPECT_TRUE(shards.set->Gather(l).ok()) << l;
  }
  EXPECT_TRUE(shards.processes->Stop().ok());
}

}  // namespace
}  // namespace layercast::testing
