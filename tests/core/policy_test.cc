#include "core/policy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"

namespace layercast {
namespace {

using ::testing::HasSubstr;

Policy MustParse(absl::string_view text) {
  absl::StatusOr<Policy> policy = Policy::Parse(text);
  EXPECT_TRUE(policy.ok()) << text << ": " << policy.status();
  return policy.ok() ? *policy : Policy();
}

struct JmpCase {
  std::string text;
  DType params, compute, output;
};

// Each expectation is what jmp.get_policy(text) returns.
TEST(PolicyTest, ParsesJmpGrammarAsJmpDoes) {
  const DType f32 = DType::kFloat32, bf16 = DType::kBFloat16, f16 = DType::kFloat16;
  const std::vector<JmpCase> cases = {
      {"params=float32,compute=bfloat16,output=float32", f32, bf16, f32},
      {"p=f32,c=bf16,o=f32", f32, bf16, f32},
      {"p=f32,c=bfloat16", f32, bf16, bf16},
      {"c=bf16", f32, bf16, bf16},
      {"c=f16", f32, f16, f16},
      {"p=f16,c=f16", f16, f16, f16},
      {"p=f16,c=bf16", f16, bf16, bf16},
      {"p=bf16", bf16, bf16, bf16},
      {"o=bf16", f32, f32, bf16},
      {"bf16", bf16, bf16, bf16},
      {"bfloat16", bf16, bf16, bf16},
      {"full", f32, f32, f32},
      {"f32", f32, f32, f32},
      {"float16", f16, f16, f16},
      {"p=full,c=float16,o=full", f32, f16, f32},
      {"c=bf16,c=f16", f32, f16, f16},  // last value wins, as in jmp
      {"compute=bf16,params=float32", f32, bf16, bf16},
  };
  for (const JmpCase& c : cases) {
    const Policy policy = MustParse(c.text);
    EXPECT_EQ(policy.params(), c.params) << c.text;
    EXPECT_EQ(policy.compute(), c.compute) << c.text;
    EXPECT_EQ(policy.output(), c.output) << c.text;
    EXPECT_TRUE(policy.overrides().empty());
  }
}

TEST(PolicyTest, RefusesHalfAndFloat64WithReason) {
  for (const char* text : {"half", "c=half", "p=f64", "float64"}) {
    absl::StatusOr<Policy> policy = Policy::Parse(text);
    ASSERT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(policy.status().message(), HasSubstr("refused")) << text;
  }
  EXPECT_THAT(Policy::Parse("half").status().message(), HasSubstr("TPU"));
}

TEST(PolicyTest, NamesTheBadPartWhereJmpFailsToUnpack) {
  struct Bad {
    std::string text, expected;
  };
  const std::vector<Bad> cases = {
      {"p=f32,", "'' is not a key=value pair"},
      {"p=f32=x", "'p=f32=x' is not a key=value pair"},
      {"p=f32, c=bf16", "unknown key ' c'"},
      {"p=f32,c=", "'c=' is not a key=value pair"},
      {"=bf16", "'=bf16' is not a key=value pair"},
      {"x=bf16", "unknown key 'x'"},
      {"c=bf8", "unknown dtype 'bf8'"},
      {"BF16", "unknown dtype 'BF16'"},
      {"", "empty"},
      {"bf16;norm", "'norm' is not an override glob=dtype"},
      {"bf16;*norm*=f8", "unknown dtype 'f8'"},
      {"c=f16,overflow=wrap", "unknown overflow rule 'wrap'"},
  };
  for (const Bad& c : cases) {
    absl::StatusOr<Policy> policy = Policy::Parse(c.text);
    ASSERT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(policy.status().message(), HasSubstr(c.expected)) << c.text;
    EXPECT_THAT(policy.status().message(), HasSubstr("'" + c.text + "'")) << c.text;
  }
  // The message lists what is accepted.
  EXPECT_THAT(Policy::Parse("x=bf16").status().message(),
              HasSubstr("params (p), compute (c), output (o)"));
  EXPECT_THAT(Policy::Parse("c=bf8").status().message(), HasSubstr("bfloat16 (bf16)"));
}

TEST(PolicyTest, OverridesResolveFirstMatchWins) {
  const Policy policy = MustParse("p=f32,c=bf16;*norm*=f32;lm_head.*=f16;*.weight=f32");
  EXPECT_EQ(policy.ComputeDTypeFor("model.layers.0.input_layernorm.weight"), DType::kFloat32);
  EXPECT_EQ(policy.ComputeDTypeFor("lm_head.weight"), DType::kFloat16);
  EXPECT_EQ(policy.ComputeDTypeFor("model.layers.0.mlp.up_proj.weight"), DType::kFloat32);
  EXPECT_EQ(policy.ComputeDTypeFor("model.layers.0.mlp.up_proj.bias"), DType::kBFloat16);
  EXPECT_EQ(policy.ComputeDTypeFor("xlm_head.weight"), DType::kFloat32);
  ASSERT_EQ(policy.overrides().size(), 3u);
  EXPECT_EQ(policy.overrides()[1], (Policy::Override{"lm_head.*", DType::kFloat16}));
}

TEST(PolicyTest, CanonicalStringRoundTrips) {
  for (const char* text : {"bf16", "c=bf16", "p=f32,c=bf16;*norm*=f32;lm_head.*=f32",
                           "c=f16,overflow=saturate", "c=f16,overflow=inf;embed*=bf16", "full",
                           "c=bf16,max_rel_error=0.01", "c=f16,max_rel_error=3e-7;x=f32"}) {
    const Policy policy = MustParse(text);
    const std::string canonical = policy.ToString();
    const Policy again = MustParse(canonical);
    EXPECT_EQ(again, policy) << text << " -> " << canonical;
    EXPECT_EQ(again.ToString(), canonical);
  }
  EXPECT_EQ(MustParse("p=f32,c=bf16;*norm*=f32").ToString(),
            "params=float32,compute=bfloat16,output=bfloat16;*norm*=float32");
  EXPECT_EQ(MustParse("c=f16,overflow=saturate").overflow(), Fp16Overflow::kSaturate);
  EXPECT_EQ(MustParse("c=f16").overflow(), Fp16Overflow::kError);
}

TEST(PolicyTest, MaxRelErrorIsABoundInZeroToOne) {
  EXPECT_EQ(MustParse("c=bf16").max_rel_error(), std::nullopt);
  EXPECT_EQ(MustParse("c=bf16,max_rel_error=0.01").max_rel_error(), 0.01f);
  EXPECT_EQ(MustParse("c=bf16,max_rel_error=1").max_rel_error(), 1.0f);
  EXPECT_EQ(MustParse("c=bf16,max_rel_error=0.01").ToString(),
            "params=float32,compute=bfloat16,output=bfloat16,max_rel_error=0.01");
  // 1e-50 is above 0 as a double and 0 as the float the policy keeps.
  for (const char* bad : {"0", "-0.1", "1.5", "nan", "inf", "0.01x", "lots", "1e-50"}) {
    const absl::StatusOr<Policy> policy = Policy::Parse(absl::StrCat("c=bf16,max_rel_error=", bad));
    ASSERT_FALSE(policy.ok()) << bad;
    EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(policy.status().message()),
                ::testing::HasSubstr(absl::StrCat("max_rel_error '", bad,
                                                  "' is not a number above 0 and at most 1")));
  }
}

TEST(PolicyTest, Float8IsAComputeDTypeWithABlockSize) {
  const Policy policy = MustParse("p=f32,c=float8_e4m3fn;*norm*=bf16;lm_head.*=f8e5m2");
  EXPECT_EQ(policy.compute(), DType::kFloat8E4M3FN);
  EXPECT_EQ(policy.output(), DType::kFloat32) << "an 8-bit compute leaves output at params";
  EXPECT_EQ(policy.fp8_block(), kDefaultFp8Block);
  EXPECT_EQ(policy.ComputeDTypeFor("lm_head.weight"), DType::kFloat8E5M2);
  EXPECT_EQ(policy.ComputeDTypeFor("model.norm.weight"), DType::kBFloat16);
  EXPECT_EQ(policy.ToString(),
            "params=float32,compute=float8_e4m3fn,output=float32,fp8_block=128;*norm*=bfloat16;"
            "lm_head.*=float8_e5m2");
  EXPECT_EQ(MustParse("c=f8e5m2,fp8_block=32").fp8_block(), 32u);
  EXPECT_EQ(MustParse("c=f8e5m2,fp8_block=256").fp8_block(), 256u);
  // Written back only where it says something: an fp8 dtype, or a block
  // that is not the default.
  EXPECT_EQ(MustParse("c=bf16").ToString(), "params=float32,compute=bfloat16,output=bfloat16");
  for (const char* text : {"c=f8e4m3,fp8_block=16", "c=bf16,fp8_block=64;x=f8e5m2",
                           "c=bf16,fp8_block=32", "c=f8e5m2,max_rel_error=0.1"}) {
    const Policy parsed = MustParse(text);
    EXPECT_EQ(MustParse(parsed.ToString()), parsed) << text << " -> " << parsed.ToString();
  }
  for (const char* bad : {"0", "8", "100", "512", "-128", "lots", "128x"}) {
    const absl::StatusOr<Policy> refused = Policy::Parse(absl::StrCat("c=f8e4m3,fp8_block=", bad));
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(refused.status().message()),
                ::testing::HasSubstr(
                    absl::StrCat("fp8_block '", bad, "' is not a power of two from 16 to 256")));
  }
  // A master or an output in 8 bits is refused, however it is written.
  for (const char* bad :
       {"float8_e4m3fn", "p=f8e5m2", "c=f8e4m3,o=f8e4m3", "p=f32,output=f8e5m2"}) {
    const absl::StatusOr<Policy> refused = Policy::Parse(bad);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_THAT(std::string(refused.status().message()),
                ::testing::HasSubstr("8-bit floats are compute dtypes only"));
  }
}

}  // namespace
}  // namespace layercast
