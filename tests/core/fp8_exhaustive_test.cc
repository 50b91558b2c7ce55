// Every fp32 bit pattern through every fp8 kernel, against the independent
// reference written from the OCP specification (tests/core/fp8_reference.h):
// Debian's PyTorch has no fp8 dtypes to compare with.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/cast.h"
#include "core/cast_error.h"
#include "core/fp8.h"
#include "tests/core/cast_error_expect.h"
#include "tests/core/every_fp32_pattern.h"
#include "tests/core/fp8_reference.h"

namespace layercast {
namespace {

using exhaustive::kBlock;

struct Scratch {
  std::vector<float> in = std::vector<float>(kBlock);
  std::vector<uint8_t> want = std::vector<uint8_t>(kBlock);
  std::vector<uint8_t> got = std::vector<uint8_t>(kBlock);
  // The patterns and the format's largest finite value, as one block.
  std::vector<float> anchored = std::vector<float>(kBlock + 1);
  std::vector<uint8_t> anchored_got = std::vector<uint8_t>(kBlock + 1);
  std::vector<float> scale = std::vector<float>(1);
};

// With scale 1 the kernels' quotient is the pattern itself, so every rounding
// case of both formats is reached: each normal and subnormal step, every tie,
// saturation, infinities, NaNs and fp32 subnormals.
//
// QuantizeFp8 has its own path, codes and measurement, for a block with
// nothing infinite or NaN (core/fp8_avx512.cc): every pattern no larger than
// the format's largest value goes through it too, in a block that value
// gives scale 1.
void ExpectEveryPatternMatches(Fp8Format format) {
  const fp8_reference::Format reference = fp8_reference::MakeFormat(format);
  const float max_finite = Fp8MaxFinite(format);
  const std::string failure =
      exhaustive::ForAllBlocks<Scratch>([&](uint32_t first, Scratch& s) -> std::string {
        // A block's patterns share a sign, so magnitudes only grow: the hint
        // makes the reference's search a step or two.
        uint8_t hint = 0;
        for (size_t i = 0; i < kBlock; ++i) {
          s.want[i] = fp8_reference::Encode(s.in[i], reference, &hint);
        }
        // Magnitudes grow within a block, so its last pattern decides.
        const bool anchorable = std::fabs(s.in[kBlock - 1]) <= max_finite;
        if (anchorable) {
          std::copy(s.in.begin(), s.in.end(), s.anchored.begin());
          s.anchored[kBlock] = max_finite;
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
          if (!anchorable) continue;
          // With a CastError too: the AVX-512 kernel measures such a block
          // from its own registers, which must agree with the table-based
          // measurement of the codes it wrote.
          CastError got;
          QuantizeFp8(s.anchored, kBlock + 1, format, s.anchored_got, s.scale, &got, isa);
          if (s.scale[0] != 1.0f) return absl::StrFormat("scale %a, want 1", s.scale[0]);
          for (size_t i = 0; i < kBlock; ++i) {
            if (s.anchored_got[i] != s.want[i]) {
              return absl::StrFormat("%s %s, one block: fp32 0x%08x (%a) gave 0x%02x, want 0x%02x",
                                     Fp8FormatName(format), CastIsaName(isa), first + i, s.in[i],
                                     s.anchored_got[i], s.want[i]);
            }
          }
          CastError want;
          MeasureFp8Error(s.anchored, s.anchored_got, 1.0f, format, &want);
          if (const std::string difference =
                  CastErrorDifference(got, want, 1e-5 * want.relative_error_sum);
              !difference.empty()) {
            return absl::StrFormat("%s %s, block from fp32 0x%08x measured: %s",
                                   Fp8FormatName(format), CastIsaName(isa), first, difference);
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
