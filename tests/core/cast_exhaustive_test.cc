// Every fp32 bit pattern through every kernel variant, against Eigen's
// independent software conversions (the references PyTorch agrees with), and
// the cast-error measurement against its definition computed here in double.

#include <gtest/gtest.h>
#include <Eigen/Core>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/cast.h"
#include "core/cast_error.h"
#include "tests/core/every_fp32_pattern.h"

namespace layercast {
namespace {

using exhaustive::kBlock;

bool IsNaN(uint32_t bits) { return (bits & 0x7FFFFFFF) > 0x7F800000; }
bool IsFinite(uint32_t bits) { return (bits & 0x7FFFFFFF) < 0x7F800000; }
uint16_t Sign16(uint32_t bits) { return static_cast<uint16_t>((bits >> 16) & 0x8000); }

// Blocks of kBlock elements each, reused from block to block.
struct Scratch {
  std::vector<float> in = std::vector<float>(kBlock);
  std::vector<uint16_t> want = std::vector<uint16_t>(kBlock);
  std::vector<uint16_t> want_saturate = std::vector<uint16_t>(kBlock);
  std::vector<uint16_t> got = std::vector<uint16_t>(kBlock);
};

template <typename Check>
std::string ForAllBlocks(Check check) {
  return exhaustive::ForAllBlocks<Scratch>(check);
}

// The first index where `got` and `want` differ, described; "" if equal.
std::string Compare(absl::string_view what, uint32_t first, const std::vector<uint16_t>& got,
                    const std::vector<uint16_t>& want) {
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(uint16_t)) == 0) return "";
  size_t i = 0;
  while (got[i] == want[i]) ++i;
  return absl::StrFormat("%s: fp32 0x%08x gave 0x%04x, want 0x%04x", what, first + i, got[i],
                         want[i]);
}

TEST(CastExhaustiveTest, F32ToBF16MatchesEigenForEveryPattern) {
  const std::string failure = ForAllBlocks([](uint32_t first, Scratch& s) {
    const std::vector<float>& in = s.in;
    std::vector<uint16_t>&want = s.want, &got = s.got;
    for (size_t i = 0; i < kBlock; ++i) {
      const uint32_t bits = first + static_cast<uint32_t>(i);
      // Eigen's NaN is already this; spelt out because it is our contract.
      want[i] = IsNaN(bits) ? Sign16(bits) | 0x7FC0
                            : Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(in[i]));
    }
    for (CastIsa isa : SupportedCastIsas()) {
      CastF32ToBF16(in, got, isa);
      std::string failure = Compare(CastIsaName(isa), first, got, want);
      if (!failure.empty()) return failure;
    }
    return std::string();
  });
  EXPECT_EQ(failure, "");
}

TEST(CastExhaustiveTest, F32ToF16MatchesEigenForEveryPatternAndOverflowRule) {
  const std::string failure = ForAllBlocks([](uint32_t first, Scratch& s) {
    const std::vector<float>& in = s.in;
    std::vector<uint16_t>&want_inf = s.want, &want_saturate = s.want_saturate, &got = s.got;
    size_t first_overflow = kBlock;
    for (size_t i = 0; i < kBlock; ++i) {
      const uint32_t bits = first + static_cast<uint32_t>(i);
      const uint16_t eigen = Eigen::numext::bit_cast<uint16_t>(Eigen::half(in[i]));
      want_inf[i] = IsNaN(bits) ? Sign16(bits) | 0x7E00 : eigen;
      const bool overflows = IsFinite(bits) && (eigen & 0x7FFF) == 0x7C00;
      want_saturate[i] = overflows ? Sign16(bits) | 0x7BFF : want_inf[i];
      if (overflows && first_overflow == kBlock) first_overflow = i;
    }
    for (CastIsa isa : SupportedCastIsas()) {
      const std::string name(CastIsaName(isa));
      absl::Status status = CastF32ToF16(in, got, Fp16Overflow::kInfinity, isa);
      if (!status.ok()) return absl::StrCat(name, " kInfinity: ", status.ToString());
      std::string failure = Compare(name + " kInfinity", first, got, want_inf);
      if (!failure.empty()) return failure;

      status = CastF32ToF16(in, got, Fp16Overflow::kSaturate, isa);
      if (!status.ok()) return absl::StrCat(name, " kSaturate: ", status.ToString());
      failure = Compare(name + " kSaturate", first, got, want_saturate);
      if (!failure.empty()) return failure;

      // kError shares its conversion with kInfinity but for the overflow test,
      // so it runs on each block with an overflow (where it stops early) and on
      // a sixteenth of the others.
      const bool want_error = first_overflow != kBlock;
      if (!want_error && first / kBlock % 16 != 0) continue;
      status = CastF32ToF16(in, got, Fp16Overflow::kError, isa);
      const std::string want_message =
          want_error ? absl::StrCat("element ", first_overflow, " is ", in[first_overflow],
                                    ", beyond float16's largest finite value 65504")
                     : "";
      if (status.ok() == want_error || (want_error && status.message() != want_message)) {
        return absl::StrFormat("%s kError on the block from 0x%08x: got %s, want %s", name, first,
                               status.ToString(), want_error ? want_message : "OK");
      }
      if (!want_error) {
        failure = Compare(name + " kError", first, got, want_inf);
        if (!failure.empty()) return failure;
      }
    }
    return std::string();
  });
  EXPECT_EQ(failure, "");
}

// core/cast_error.h's definition, in double, for the cast Eigen gives
// (written to `out`): independent of the kernels and of their arithmetic.
template <typename Half>
CastError ReferenceCastError(const std::vector<float>& in, std::vector<uint16_t>& out) {
  const double least_normal = static_cast<double>(std::numeric_limits<Half>::min());
  CastError want;
  want.elements = in.size();
  for (size_t i = 0; i < in.size(); ++i) {
    const Half cast(in[i]);
    out[i] = Eigen::numext::bit_cast<uint16_t>(cast);
    const double x = in[i], c = static_cast<float>(cast);
    if (!std::isfinite(x) || x == 0) continue;
    if (std::isinf(c)) {
      ++want.overflowed;
      continue;
    }
    if (c == 0) {
      ++want.flushed_to_zero;
    } else if (std::fabs(c) < least_normal && std::fpclassify(in[i]) == FP_NORMAL) {
      ++want.became_subnormal;
    }
    ++want.measured;
    // Rounding the double quotient to float rounds once: 53 >= 2 * 24 + 2 bits.
    const float relative = static_cast<float>(std::fabs(c - x) / std::fabs(x));
    for (int k = 0; k < CastError::kBuckets; ++k) want.above[k] += relative > CastError::kBounds[k];
    want.relative_error_sum += relative;
    want.max_relative_error = std::max(want.max_relative_error, relative);
  }
  return want;
}

// "" when `got` equals `want`: every count and the maximum exactly, the sum
// to 1e-5 (kernels add in their own order).
std::string CompareCastError(absl::string_view what, uint32_t first, const CastError& got,
                             const CastError& want) {
  const bool counts = got.elements == want.elements && got.overflowed == want.overflowed &&
                      got.flushed_to_zero == want.flushed_to_zero &&
                      got.became_subnormal == want.became_subnormal &&
                      got.measured == want.measured && got.above == want.above;
  const bool sum = std::fabs(got.relative_error_sum - want.relative_error_sum) <=
                   1e-5 * want.relative_error_sum + 1e-30;
  if (counts && sum && got.max_relative_error == want.max_relative_error) return "";
  auto show = [](const CastError& e) {
    return absl::StrCat(e.Describe(), "; measured ", e.measured, ", above ",
                        absl::StrJoin(e.above, "/"), ", sum ", e.relative_error_sum);
  };
  return absl::StrFormat("%s, block from 0x%08x: got %s; want %s", what, first, show(got),
                         show(want));
}

TEST(CastExhaustiveTest, CastErrorMatchesItsDefinitionForEveryPattern) {
  const std::string failure = ForAllBlocks([](uint32_t first, Scratch& s) {
    for (DType to : {DType::kBFloat16, DType::kFloat16}) {
      const CastError want = to == DType::kBFloat16
                                 ? ReferenceCastError<Eigen::bfloat16>(s.in, s.want)
                                 : ReferenceCastError<Eigen::half>(s.in, s.want);
      for (CastIsa isa : SupportedCastIsas()) {
        if (isa == CastIsa::kAvx512Bf16) continue;  // kAvx512's kernel
        CastError got;
        MeasureCastError(s.in.data(), s.want.data(), kBlock, to, &got, isa);
        std::string failure =
            CompareCastError(absl::StrCat(DTypeName(to), " ", CastIsaName(isa)), first, got, want);
        if (!failure.empty()) return failure;
      }
      // The cast that measures as it goes, on a sixteenth of the blocks.
      if (first / kBlock % 16 != 0) continue;
      CastError got;
      const absl::Status status =
          CastFromF32(s.in.data(), s.got.data(), kBlock, to, Fp16Overflow::kInfinity, &got);
      if (!status.ok()) return status.ToString();
      std::string failure =
          CompareCastError(absl::StrCat("CastFromF32 to ", DTypeName(to)), first, got, want);
      if (!failure.empty()) return failure;
    }
    return std::string();
  });
  EXPECT_EQ(failure, "");
}

// Widening is exact, so narrowing it again gives back every non-NaN pattern.
TEST(CastExhaustiveTest, WideningEvery16BitPatternMatchesEigen) {
  std::vector<uint16_t> all(1 << 16), back(1 << 16);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<uint32_t> bf16_want(all.size()), f16_want(all.size());
  for (uint16_t h : all) {
    bf16_want[h] =
        std::bit_cast<uint32_t>(static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(h)));
    f16_want[h] =
        std::bit_cast<uint32_t>(static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h)));
  }
  std::vector<float> wide(all.size()), scalar_bf16(all.size()), scalar_f16(all.size());
  CastBF16ToF32(all, scalar_bf16, CastIsa::kScalar);
  CastF16ToF32(all, scalar_f16, CastIsa::kScalar);
  for (CastIsa isa : SupportedCastIsas()) {
    SCOPED_TRACE(CastIsaName(isa));
    for (bool f16 : {false, true}) {
      SCOPED_TRACE(f16 ? "float16" : "bfloat16");
      const std::vector<uint32_t>& want = f16 ? f16_want : bf16_want;
      if (f16) {
        CastF16ToF32(all, wide, isa);
        ASSERT_TRUE(CastF32ToF16(wide, back, Fp16Overflow::kError, isa).ok());
      } else {
        CastBF16ToF32(all, wide, isa);
        CastF32ToBF16(wide, back, isa);
      }
      // Every variant gives the same bits, NaN payloads included.
      const std::vector<float>& scalar = f16 ? scalar_f16 : scalar_bf16;
      ASSERT_EQ(std::memcmp(wide.data(), scalar.data(), wide.size() * sizeof(float)), 0);
      for (uint16_t h : all) {
        const uint32_t got = std::bit_cast<uint32_t>(wide[h]);
        if (IsNaN(want[h])) {
          ASSERT_TRUE(IsNaN(got) && (got >> 31) == (want[h] >> 31))
              << absl::StrFormat("0x%04x widened to 0x%08x", h, got);
        } else {
          ASSERT_EQ(got, want[h]) << absl::StrFormat("0x%04x", h);
          ASSERT_EQ(back[h], h) << absl::StrFormat("0x%04x", h);
        }
      }
    }
  }
}

}  // namespace
}  // namespace layercast
