// Cast error against real shard processes: a policy's max_rel_error refuses
// a layer whose cast loses more than the bound, naming the layer and the
// figure, and serves every other layer as usual; GetCastError reports what
// each layer's cast lost.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cast_error_report.h"
#include "core/cast.h"
#include "core/cast_error.h"
#include "core/policy.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

// What casting the tensors of `layer` that `policy` narrows loses, whole.
CastError LayerCastError(const TestModel& model, const LayerSpec& layer, const Policy& policy) {
  CastError lost;
  for (const TensorSpec& tensor : layer.tensors) {
    const std::vector<float>& values = model.values.at(tensor.name);
    const DType dtype = policy.ComputeDTypeFor(tensor.name);
    if (dtype == DType::kFloat32) continue;
    std::vector<uint8_t> out(values.size() * DTypeSize(dtype));
    EXPECT_TRUE(
        CastFromF32(values.data(), out.data(), values.size(), dtype, policy.overflow(), &lost)
            .ok());
  }
  return lost;
}

float LayerMaxRelativeError(const TestModel& model, const LayerSpec& layer, const Policy& policy) {
  return LayerCastError(model, layer, policy).max_relative_error;
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
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
}

void ExpectReportsWhatEachLayersCastLost(bool exact) {
  const std::string policy_text = "p=f32,c=bf16;*norm*=f32";
  const Policy policy = *Policy::Parse(policy_text);
  const TestModel model = WriteTestModel(MakeTempDir("model") + "/model.safetensors", 3, 42);
  RunningShards shards = StartShards(2, {"--model", model.path, "--policy", policy_text,
                                         "--cast-error-sample-every", exact ? "1" : "16"});
  ASSERT_NE(shards.set, nullptr);
  const ModelSpec& spec = shards.set->model();
  absl::StatusOr<std::vector<client::LayerCastReport>> before =
      client::FetchCastErrorReport(*shards.set);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_TRUE(before->empty()) << "nothing was cast yet";

  for (int round = 0; round < 2; ++round) {
    for (uint32_t l = 0; l < spec.layers.size(); ++l) {
      ASSERT_TRUE(shards.set->Gather(l).ok()) << l;
    }
    absl::StatusOr<std::vector<client::LayerCastReport>> report =
        client::FetchCastErrorReport(*shards.set);
    ASSERT_TRUE(report.ok()) << report.status();
    ASSERT_EQ(report->size(), spec.layers.size());
    for (const client::LayerCastReport& row : *report) {
      SCOPED_TRACE(absl::StrCat("round ", round, ", layer ", row.layer));
      ASSERT_LT(row.layer, spec.layers.size());
      const CastError want = LayerCastError(model, spec.layers[row.layer], policy);
      EXPECT_EQ(row.dtype, DType::kBFloat16);
      EXPECT_EQ(row.version, shards.set->manifests()[0].version());
      EXPECT_EQ(row.shards, 2u);
      EXPECT_EQ(row.error.elements, want.elements);
      EXPECT_EQ(row.error.flushed_to_zero, want.flushed_to_zero);
      EXPECT_EQ(row.error.became_subnormal, want.became_subnormal);
      EXPECT_EQ(row.error.overflowed, want.overflowed);
      EXPECT_EQ(row.error.measured + row.error.unmeasured, want.measured);
      if (exact) {
        EXPECT_EQ(row.error.unmeasured, 0u);
        EXPECT_EQ(row.error.above, want.above);
        EXPECT_EQ(row.error.max_relative_error, want.max_relative_error);
        EXPECT_NEAR(row.error.relative_error_sum, want.relative_error_sum,
                    1e-5 * want.relative_error_sum);
      } else if (want.max_relative_error > RelativeErrorBound(DType::kBFloat16)) {
        EXPECT_EQ(row.error.max_relative_error, want.max_relative_error) << "a rare element's";
      } else {
        EXPECT_LE(row.error.max_relative_error, want.max_relative_error);
      }
    }
  }
  if (!exact) {
    // The test model's values are mostly normal: most vectors go unmeasured
    // where the kernels sample (AVX-512), and none elsewhere.
    const absl::StatusOr<std::vector<client::LayerCastReport>> report =
        client::FetchCastErrorReport(*shards.set);
    ASSERT_TRUE(report.ok());
    uint64_t unmeasured = 0;
    for (const client::LayerCastReport& row : *report) unmeasured += row.error.unmeasured;
    const std::vector<CastIsa>& isas = SupportedCastIsas();
    EXPECT_EQ(unmeasured > 0, std::find(isas.begin(), isas.end(), CastIsa::kAvx512) != isas.end());
  }
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
}

// GetCastError against real shards: each layer's row adds up the shards'
// slices to what casting its tensors whole loses, and serving a layer again
// at the same version measures (and counts) nothing again. Measuring every
// element, every figure is exact; sampled (the default), the counts of lost
// elements and a maximum beyond bf16's unit roundoff still are.
TEST(CastErrorReportTest, TheShardsReportWhatEachLayersCastLost) {
  for (const bool exact : {true, false}) {
    SCOPED_TRACE(exact ? "every element measured" : "sampled");
    ASSERT_NO_FATAL_FAILURE(ExpectReportsWhatEachLayersCastLost(exact));
  }
}

TEST(CastErrorBoundTest, WithoutABoundEveryLayerIsServed) {
  const TestModel model = WriteTestModel(MakeTempDir("model") + "/model.safetensors", 2, 42);
  RunningShards shards = StartShards(2, {"--model", model.path, "--policy", "p=f32,c=bf16"});
  ASSERT_NE(shards.set, nullptr);
  for (uint32_t l = 0; l < shards.set->model().layers.size(); ++l) {
    EXPECT_TRUE(shards.set->Gather(l).ok()) << l;
  }
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
}

}  // namespace
}  // namespace layercast::testing
