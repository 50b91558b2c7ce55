// The optimizer's contract apart from its bits (optimizer_torch_test.cc checks
// those against PyTorch).

#include "core/optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace layercast {
namespace {

using ::testing::HasSubstr;

OptimizerSpec MustParse(absl::string_view text) {
  absl::StatusOr<OptimizerSpec> spec = OptimizerSpec::Parse(text);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

TEST(OptimizerTest, StateFloatsPerElementSizesTheBuffers) {
  const OptimizerHyper plain = MustParse("sgd:lr=0.1").defaults();
  const OptimizerHyper momentum = MustParse("sgd:lr=0.1,momentum=0.9").defaults();
  const OptimizerHyper adamw = MustParse("adamw:lr=0.1").defaults();
  EXPECT_EQ(StateFloatsPerElement(OptimizerKind::kSgd, plain), 0u);
  EXPECT_EQ(StateFloatsPerElement(OptimizerKind::kSgd, momentum), 1u);
  EXPECT_EQ(StateFloatsPerElement(OptimizerKind::kAdamW, adamw), 2u);

  EXPECT_TRUE(TensorOptimizer(OptimizerKind::kSgd, plain, 10).momentum_buffer().empty());
  EXPECT_EQ(TensorOptimizer(OptimizerKind::kSgd, momentum, 10).momentum_buffer().size(), 10u);
  const TensorOptimizer adam(OptimizerKind::kAdamW, adamw, 10);
  EXPECT_EQ(adam.exp_avg().size(), 10u);
  EXPECT_EQ(adam.exp_avg_sq().size(), 10u);
  EXPECT_TRUE(adam.momentum_buffer().empty());
}

TEST(OptimizerTest, StepRejectsWrongSizesAndLrChangingNothing) {
  TensorOptimizer optimizer(OptimizerKind::kAdamW, MustParse("adamw:lr=0.1").defaults(), 4);
  std::vector<float> param = {1, 2, 3, 4}, grad = {1, 1, 1, 1};
  const std::vector<float> before = param;
  absl::Status status = optimizer.Step(0.1, std::span<float>(param).first(3), grad);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("param has 3 elements and grad 4"));
  EXPECT_THAT(status.message(), HasSubstr("holds 4"));
  EXPECT_EQ(optimizer.Step(0.1, param, std::span<const float>(grad).first(2)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer.Step(-0.1, param, grad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(optimizer.Step(NAN, param, grad).message(), HasSubstr("not a finite number >= 0"));
  EXPECT_EQ(param, before);
  EXPECT_EQ(optimizer.steps(), 0u);
  ASSERT_TRUE(optimizer.Step(0.1, param, grad).ok());
  EXPECT_EQ(optimizer.steps(), 1u);
  EXPECT_NE(param, before);
}

// A shard updates its slice of a tensor; the bits must not depend on where
// the slice starts or ends.
TEST(OptimizerTest, SlicesUpdateLikeTheWholeTensor) {
  for (absl::string_view text :
       {"sgd:lr=0.1,momentum=0.9,nesterov=1,weight_decay=0.01", "adamw:lr=1e-3,weight_decay=0.1"}) {
    const OptimizerSpec spec = MustParse(text);
    std::vector<float> whole(37), grad(37);
    for (size_t i = 0; i < whole.size(); ++i) {
      whole[i] = std::sin(static_cast<float>(i)) * 3;
      grad[i] = std::cos(static_cast<float>(i * 7)) / 5;
    }
    std::vector<float> sliced = whole;
    TensorOptimizer all(spec.kind(), spec.defaults(), 37);
    TensorOptimizer head(spec.kind(), spec.defaults(), 13), tail(spec.kind(), spec.defaults(), 24);
    for (int step = 0; step < 3; ++step) {
      ASSERT_TRUE(all.Step(1e-2, whole, grad).ok());
      ASSERT_TRUE(head.Step(1e-2, std::span<float>(sliced).first(13),
                            std::span<const float>(grad).first(13))
                      .ok());
      ASSERT_TRUE(tail.Step(1e-2, std::span<float>(sliced).subspan(13),
                            std::span<const float>(grad).subspan(13))
                      .ok());
    }
    EXPECT_EQ(sliced, whole) << text;
  }
}

TEST(OptimizerTest, ClipScaleIsClipGradNormsCoefficient) {
  EXPECT_EQ(ClipScale(0, 1), 1.0f);
  EXPECT_EQ(ClipScale(0.5, 1), 1.0f);
  EXPECT_EQ(ClipScale(4, 1), (1.0f / (4.0f + static_cast<float>(1e-6))) * 1.0f);
  EXPECT_EQ(ClipScale(INFINITY, 1), 0.0f);
  EXPECT_TRUE(std::isnan(ClipScale(NAN, 1)));
}

}  // namespace
}  // namespace layercast
