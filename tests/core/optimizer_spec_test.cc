#include "core/optimizer_spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace layercast {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

OptimizerSpec MustParse(absl::string_view text) {
  absl::StatusOr<OptimizerSpec> spec = OptimizerSpec::Parse(text);
  EXPECT_TRUE(spec.ok()) << text << ": " << spec.status();
  return spec.ok() ? *spec : *OptimizerSpec::Parse("sgd:lr=0");
}

TEST(OptimizerSpecTest, ParsesAdamWWithEveryKey) {
  const OptimizerSpec spec = MustParse(
      "adamw:lr=3e-4,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1,warmup_steps=100,"
      "decay_steps=10000,min_lr=3e-5,clip=1.0;*norm*:weight_decay=0");
  EXPECT_EQ(spec.kind(), OptimizerKind::kAdamW);
  EXPECT_EQ(
      spec.defaults(),
      (OptimizerHyper{.lr = 3e-4, .weight_decay = 0.1, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8}));
  EXPECT_EQ(spec.warmup_steps(), 100u);
  EXPECT_EQ(spec.decay_steps(), 10000u);
  EXPECT_EQ(spec.min_lr(), 3e-5);
  EXPECT_EQ(spec.clip(), 1.0);
  ASSERT_EQ(spec.overrides().size(), 1u);
  EXPECT_EQ(spec.overrides()[0].glob, "*norm*");
  EXPECT_EQ(spec.overrides()[0].weight_decay, 0.0);
  EXPECT_FALSE(spec.overrides()[0].lr.has_value());
}

TEST(OptimizerSpecTest, ParsesSgd) {
  const OptimizerSpec spec = MustParse("sgd:lr=0.1,momentum=0.9,nesterov=1,weight_decay=1e-4");
  EXPECT_EQ(spec.kind(), OptimizerKind::kSgd);
  EXPECT_EQ(spec.defaults(),
            (OptimizerHyper{.lr = 0.1, .weight_decay = 1e-4, .momentum = 0.9, .nesterov = true}));
  EXPECT_EQ(spec.clip(), std::nullopt);
  EXPECT_EQ(MustParse("sgd:lr=1,nesterov=false,dampening=0,momentum=0").defaults().nesterov, false);
}

TEST(OptimizerSpecTest, DefaultsAreTorchs) {
  EXPECT_EQ(MustParse("sgd:lr=0.1").defaults(), (OptimizerHyper{.lr = 0.1}));
  const OptimizerHyper adamw = MustParse("adamw:lr=1e-3").defaults();
  EXPECT_EQ(adamw.weight_decay, 1e-2);
  EXPECT_EQ(adamw.beta1, 0.9);
  EXPECT_EQ(adamw.beta2, 0.999);
  EXPECT_EQ(adamw.eps, 1e-8);
  const OptimizerSpec constant = MustParse("adamw:lr=1e-3");
  EXPECT_EQ(constant.warmup_steps(), 0u);
  EXPECT_EQ(constant.decay_steps(), 0u);
  EXPECT_EQ(constant.clip(), std::nullopt);
}

TEST(OptimizerSpecTest, FirstMatchingOverrideWinsAsInPolicy) {
  const OptimizerSpec spec = MustParse(
      "adamw:lr=1e-3,beta2=0.95;*norm*:weight_decay=0;*.norm.*:lr=5;lm_head.*:lr=1e-4,"
      "beta1=0.8;*:eps=1e-6");
  const OptimizerHyper norm = spec.HyperFor("layers.0.norm.weight");
  EXPECT_EQ(norm.weight_decay, 0);
  EXPECT_EQ(norm.lr, 1e-3);  // the later '*.norm.*' rule also matches but loses
  EXPECT_EQ(norm.eps, 1e-8);
  EXPECT_EQ(norm.beta2, 0.95);  // keys an override leaves out come from the first part

  const OptimizerHyper head = spec.HyperFor("lm_head.weight");
  EXPECT_EQ(head.lr, 1e-4);
  EXPECT_EQ(head.beta1, 0.8);
  EXPECT_EQ(head.weight_decay, 1e-2);

  EXPECT_EQ(spec.HyperFor("layers.0.attn.weight").eps, 1e-6);  // '*' matches dots
  EXPECT_EQ(MustParse("adamw:lr=1e-3;lm_head:lr=0").HyperFor("lm_head.weight").lr, 1e-3)
      << "a glob matches the whole name only";
}

TEST(OptimizerSpecTest, ScheduleWarmsUpThenDecaysByCosine) {
  const OptimizerSpec spec =
      MustParse("adamw:lr=1e-3,warmup_steps=4,decay_steps=10,min_lr=1e-4;*norm*:lr=2e-3");
  const OptimizerHyper base = spec.defaults();
  EXPECT_EQ(spec.LearningRate(base, 0), 0);
  EXPECT_DOUBLE_EQ(spec.LearningRate(base, 1), 0.25e-3);
  EXPECT_DOUBLE_EQ(spec.LearningRate(base, 4), 1e-3);
  EXPECT_DOUBLE_EQ(spec.LearningRate(base, 9),
                   1e-4 + 0.9e-3 * (1 + std::cos(std::numbers::pi * 5 / 10)) / 2);
  EXPECT_DOUBLE_EQ(spec.LearningRate(base, 14), 1e-4);
  EXPECT_DOUBLE_EQ(spec.LearningRate(base, 1000), 1e-4);
  // An overridden lr follows the same curve, scaled.
  const OptimizerHyper norm = spec.HyperFor("final_norm.weight");
  for (uint64_t step : {1, 4, 7, 14, 20}) {
    EXPECT_DOUBLE_EQ(spec.LearningRate(norm, step), 2 * spec.LearningRate(base, step)) << step;
  }
  const OptimizerSpec constant = MustParse("sgd:lr=0.1");
  EXPECT_EQ(constant.LearningRate(constant.defaults(), 1), 0.1);
  EXPECT_EQ(constant.LearningRate(constant.defaults(), 1000000), 0.1);
  const OptimizerSpec warmup_only = MustParse("sgd:lr=0.1,warmup_steps=10");
  EXPECT_DOUBLE_EQ(warmup_only.LearningRate(warmup_only.defaults(), 5), 0.05);
  EXPECT_EQ(warmup_only.LearningRate(warmup_only.defaults(), 11), 0.1);
}

TEST(OptimizerSpecTest, ToStringParsesBackToTheSameSpec) {
  for (absl::string_view text : {
           "sgd:lr=0.1",
           "sgd:lr=0.1,momentum=0.9,nesterov=1,weight_decay=1e-4,clip=0.5",
           "adamw:lr=3e-4,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1,warmup_steps=100,"
           "decay_steps=10000,min_lr=3e-5,clip=1.0;*norm*:weight_decay=0",
           "adamw:lr=0.1234567890123,beta2=0.99999;a*:lr=0,eps=0;b?[xy]:beta1=0",
           "sgd:lr=1e-300,momentum=0.5;*bias:nesterov=1,momentum=3;c:nesterov=0",
       }) {
    const OptimizerSpec spec = MustParse(text);
    const std::string canonical = spec.ToString();
    EXPECT_EQ(MustParse(canonical), spec) << text << " -> " << canonical;
    EXPECT_EQ(MustParse(canonical).ToString(), canonical);
  }
  EXPECT_EQ(MustParse("adamw:weight_decay=0.1,lr=3e-4,beta2=0.95;*norm*:weight_decay=0").ToString(),
            "adamw:lr=3e-04,weight_decay=0.1,beta1=0.9,beta2=0.95,eps=1e-08;*norm*:weight_decay=0");
  EXPECT_EQ(MustParse("sgd:lr=0.1,warmup_steps=5,decay_steps=7").ToString(),
            "sgd:lr=0.1,weight_decay=0,momentum=0,nesterov=0,warmup_steps=5,decay_steps=7,"
            "min_lr=0");
}

struct BadSpec {
  std::string text;
  std::vector<std::string> message_parts;
};

TEST(OptimizerSpecTest, RejectsBadSpecsSayingWhatIsValid) {
  const std::vector<BadSpec> cases = {
      {"", {"lacks the ':' after the optimizer kind (sgd or adamw)"}},
      {"adamw", {"'adamw' lacks the ':'"}},
      {"adam:lr=1", {"unknown optimizer kind 'adam': use sgd or adamw"}},
      {"adamw:", {"'' is not a key=value pair"}},
      {"adamw:lr", {"'lr' is not a key=value pair"}},
      {"adamw:lr=1,", {"'' is not a key=value pair"}},
      {"adamw:lr=1=2", {"'lr=1=2' is not a key=value pair"}},
      {"adamw:beta1=0.9", {"lr is required, e.g. 'adamw:lr=3e-4'"}},
      {"sgd:momentum=0.9", {"lr is required, e.g. 'sgd:lr=0.1'"}},
      {"adamw:lr=1,lr=2", {"key 'lr' is given twice"}},
      {"adamw:lr=1,speed=2", {"unknown key 'speed'", "adamw takes lr, weight_decay, beta1"}},
      {"adamw:lr=1,momentum=0.9", {"key 'momentum' is not valid for adamw", "adamw takes"}},
      {"adamw:lr=1,nesterov=1", {"key 'nesterov' is not valid for adamw"}},
      {"sgd:lr=1,beta1=0.9", {"key 'beta1' is not valid for sgd", "sgd takes lr, weight_decay"}},
      {"sgd:lr=1,eps=1e-8", {"key 'eps' is not valid for sgd"}},
      {"adamw:lr=fast", {"lr=fast: 'fast' is not a finite number such as 0.1 or 3e-4"}},
      {"adamw:lr=1e-3x", {"lr=1e-3x: '1e-3x' is not a finite number"}},
      {"adamw:lr= 1", {"lr= 1: ' 1' is not a finite number"}},
      {"adamw:lr=inf", {"lr=inf: 'inf' is not a finite number"}},
      {"adamw:lr=nan", {"'nan' is not a finite number"}},
      {"adamw:lr=1e999", {"'1e999' is not a finite number"}},
      {"adamw:lr=-1e-3", {"lr=-1e-3: lr must be >= 0"}},
      {"adamw:lr=-0", {"lr=-0: lr must be >= 0"}},
      {"adamw:lr=1,weight_decay=-0.1", {"weight_decay=-0.1: weight_decay must be >= 0"}},
      {"adamw:lr=1,eps=-1", {"eps=-1: eps must be >= 0"}},
      {"adamw:lr=1,beta1=1", {"beta1=1: beta1 must be in [0, 1)"}},
      {"adamw:lr=1,beta2=-0.1", {"beta2=-0.1: beta2 must be in [0, 1)"}},
      {"adamw:lr=1,beta2=1.5", {"beta2=1.5: beta2 must be in [0, 1)"}},
      {"sgd:lr=1,momentum=-0.9", {"momentum=-0.9: momentum must be >= 0"}},
      {"sgd:lr=1,nesterov=yes", {"nesterov=yes: use 1, 0, true or false"}},
      {"sgd:lr=1,nesterov=1", {"nesterov=1 needs momentum > 0", "the first part has momentum 0"}},
      {"sgd:lr=1,momentum=0.9;*norm*:momentum=0,nesterov=1",
       {"nesterov=1 needs momentum > 0", "a tensor matching '*norm*' has momentum 0"}},
      {"sgd:lr=1,dampening=0.1", {"dampening=0.1: only dampening=0 (torch's default)"}},
      {"adamw:lr=1,dampening=0", {"key 'dampening' is not valid for adamw"}},
      {"adamw:lr=1,warmup_steps=-5", {"warmup_steps=-5: '-5' is not a whole number of steps"}},
      {"adamw:lr=1,decay_steps=1.5", {"decay_steps=1.5: '1.5' is not a whole number"}},
      {"adamw:lr=1,min_lr=0.1", {"min_lr is the end of the cosine decay: give decay_steps"}},
      {"adamw:lr=1e-3,decay_steps=10,min_lr=0.1", {"min_lr 0.1 exceeds lr 0.001"}},
      {"adamw:lr=1,clip=0", {"clip=0: the max gradient norm must be > 0"}},
      {"adamw:lr=1,clip=-1", {"clip=-1: the max gradient norm must be > 0"}},
      {"adamw:lr=1;*norm*", {"override '*norm*' is not glob:key=value"}},
      {"adamw:lr=1;*norm*:", {"override '*norm*:' is not glob:key=value"}},
      {"adamw:lr=1;:lr=2", {"override ':lr=2' is not glob:key=value"}},
      {"adamw:lr=1;", {"override '' is not glob:key=value"}},
      {"adamw:lr=1;*norm*:weight_decay", {"'weight_decay' is not a key=value pair"}},
      {"adamw:lr=1;*norm*:clip=1",
       {"override '*norm*:clip=1': key 'clip' cannot be set per tensor",
        "adamw overrides take lr, weight_decay, beta1, beta2, eps"}},
      {"adamw:lr=1;*norm*:warmup_steps=1", {"key 'warmup_steps' cannot be set per tensor"}},
      {"sgd:lr=1;*norm*:beta1=0.5",
       {"key 'beta1' cannot be set per tensor", "sgd overrides take lr, weight_decay, momentum"}},
      {"adamw:lr=1;*norm*:lr=1,lr=2", {"key 'lr' is given twice"}},
      {"adamw:lr=1;*norm*:beta1=1", {"beta1=1: beta1 must be in [0, 1)"}},
  };
  for (const BadSpec& bad : cases) {
    absl::StatusOr<OptimizerSpec> spec = OptimizerSpec::Parse(bad.text);
    ASSERT_FALSE(spec.ok()) << bad.text;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << bad.text;
    EXPECT_THAT(spec.status().message(), HasSubstr("optimizer spec '" + bad.text + "': "));
    for (const std::string& part : bad.message_parts) {
      EXPECT_THAT(spec.status().message(), HasSubstr(part)) << bad.text;
    }
  }
}

}  // namespace
}  // namespace layercast
