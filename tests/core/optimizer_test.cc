// The optimizer's contract apart from its bits (optimizer_torch_test.cc checks
// those against PyTorch).

#include "core/optimizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <utility>
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

// What a checkpoint saves and restores: an optimizer rebuilt from its state
// buffers and step count continues with the same bits as the original.
TEST(OptimizerTest, RestoredStateContinuesBitForBit) {
  for (const auto& tried :
       {std::pair{OptimizerKind::kAdamW,
                  OptimizerHyper{.lr = 1e-2, .weight_decay = 0.1, .beta2 = 0.95}},
        std::pair{OptimizerKind::kSgd,
                  OptimizerHyper{.lr = 0.1, .momentum = 0.9, .nesterov = true}},
        std::pair{OptimizerKind::kSgd, OptimizerHyper{.lr = 0.1}}}) {
    // Not a structured binding: clang 14 cannot capture one in the lambda.
    const OptimizerKind kind = tried.first;
    const OptimizerHyper& hyper = tried.second;
    constexpr size_t kSize = 97;
    std::vector<float> param(kSize), grad(kSize);
    for (size_t i = 0; i < kSize; ++i) param[i] = std::sin(static_cast<float>(i));
    TensorOptimizer original(kind, hyper, kSize);
    const auto step = [&](TensorOptimizer& optimizer, std::vector<float>& p, int k) {
      for (size_t i = 0; i < kSize; ++i) grad[i] = std::cos(static_cast<float>(i * 3 + k));
      ASSERT_TRUE(optimizer.Step(hyper.lr, p, grad).ok());
    };
    for (int k = 0; k < 3; ++k) step(original, param, k);
    std::vector<std::vector<float>> saved;
    for (const auto& [name, values] : original.StateBuffers()) {
      saved.emplace_back(values.begin(), values.end());
    }
    EXPECT_EQ(saved.size(), StateFloatsPerElement(kind, hyper));
    TensorOptimizer restored(kind, hyper, kSize);
    EXPECT_EQ(restored.Restore(3, {{1.0f}}).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(restored.Restore(3, saved).ok());
    EXPECT_EQ(restored.steps(), 3u);
    std::vector<float> copy = param;
    for (int k = 3; k < 6; ++k) {
      step(original, param, k);
      step(restored, copy, k);
    }
    EXPECT_EQ(std::memcmp(param.data(), copy.data(), kSize * sizeof(float)), 0);
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
