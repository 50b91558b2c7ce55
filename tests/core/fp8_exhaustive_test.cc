// Every fp32 bit pattern through every fp8 kernel, against the independent
// reference written from the OCP specification (tests/core/fp8_reference.h):
// Debian's PyTorch has no fp8 dtypes to compare with.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/cast.h"
#include "core/fp8.h"
#include "tests/core/every_fp32_pattern.h"
#include "tests/core/fp8_reference.h"

namespace layercast {
namespace {

using exhaustive::kBlock;

struct Scratch {
  std::vector<float> in = std::vector<float>(kBlock);
  std::vector<uint8_t> want = std::vector<uint8_t>(kBlock);
  std::vector<uint8_t> got = std::vector<uint8_t>(kBlock);
};

// With scale 1 the kernels' quotient is the pattern itself, so every rounding
// case of both formats is reached: each normal and subnormal step, every tie,
// saturation, infinities, NaNs and fp32 subnormals.
void ExpectEveryPatternMatches(Fp8Format format) {
  const fp8_reference::Format reference = fp8_reference::MakeFormat(format);
  const std::string failure =
      exhaustive::ForAllBlocks<Scratch>([&](uint32_t first, Scratch& s) -> std::string {
        // A block's patterns share a sign, so magnitudes only grow: the hint
        // makes the reference's search a step or two.
        uint8_t hint = 0;
        for (size_t i = 0; i < kBlock; ++i) {
          s.want[i] = fp8_reference::Encode(s.in[i], reference, &hint);
        }
        for (CastIsa isa : SupportedCastIsas()) {
          if (isa == CastIsa::kAvx512Bf16) continue;  // kAvx512's fp8 kernel
          QuantizeFp8WithScale(s.in, 1.0f, format, s.got, isa);
          for (size_t i = 0; i < kBlock; ++i) {
            if (s.got[i] != s.want[i]) {
              return absl::StrFormat("%s %s: fp32 0x%08x (%a) gave 0x%02x, want 0x%02x",
                                     Fp8FormatName(format), CastIsaName(isa), first + i, s.in[i],
                                     s.got[i], s.want[i]);
            }
          }
        }
        return "";
      });
  EXPECT_EQ(failure, "");
}

TEST(Fp8ExhaustiveTest, E4M3FNMatchesTheReferenceForEveryPattern) {
  ExpectEveryPatternMatches(Fp8Format::kE4M3FN);
}

TEST(Fp8ExhaustiveTest, E5M2MatchesTheReferenceForEveryPattern) {
  ExpectEveryPatternMatches(Fp8Format::kE5M2);
}

}  // namespace
}  // namespace layercast
