#include "core/fp8.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "core/cast.h"
#include "core/cast_error.h"
#include "tests/core/cast_error_expect.h"
#include "tests/core/fp8_reference.h"

namespace layercast {
namespace {

constexpr Fp8Format kFormats[] = {Fp8Format::kE4M3FN, Fp8Format::kE5M2};
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(Fp8Test, NamesAndLimitsFollowTheSpecification) {
  EXPECT_EQ(Fp8FormatName(Fp8Format::kE4M3FN), "float8_e4m3fn");
  EXPECT_EQ(Fp8FormatName(Fp8Format::kE5M2), "float8_e5m2");
  EXPECT_EQ(Fp8MaxFinite(Fp8Format::kE4M3FN), 448.0f);
  EXPECT_EQ(Fp8MaxFinite(Fp8Format::kE5M2), 57344.0f);
  EXPECT_EQ(Fp8ToF32(0x01, Fp8Format::kE4M3FN), 0x1p-9f);  // least subnormal
  EXPECT_EQ(Fp8ToF32(0x08, Fp8Format::kE4M3FN), 0x1p-6f);  // least normal
  EXPECT_EQ(Fp8ToF32(0x01, Fp8Format::kE5M2), 0x1p-16f);
  EXPECT_EQ(Fp8ToF32(0x04, Fp8Format::kE5M2), 0x1p-14f);
  EXPECT_EQ(Fp8ToF32(0x7C, Fp8Format::kE5M2), kInf);
  EXPECT_EQ(Fp8ToF32(0xFC, Fp8Format::kE5M2), -kInf);
  EXPECT_EQ(Fp8ToF32(0x80, Fp8Format::kE4M3FN), 0.0f);
  EXPECT_TRUE(std::signbit(Fp8ToF32(0x80, Fp8Format::kE4M3FN)));
}

TEST(Fp8Test, EveryCodeDecodesToTheReferenceValue) {
  for (Fp8Format format : kFormats) {
    const fp8_reference::Format reference = fp8_reference::MakeFormat(format);
    for (int code = 0; code < 256; ++code) {
      const float got = Fp8ToF32(static_cast<uint8_t>(code), format);
      const int magnitude = code & 0x7F;
      SCOPED_TRACE(testing::Message() << Fp8FormatName(format) << " code " << code);
      EXPECT_EQ(std::signbit(got), code >= 0x80);
      if (magnitude <= reference.max_code) {
        EXPECT_EQ(std::fabs(got), reference.values[magnitude]);
      } else if (format == Fp8Format::kE5M2 && magnitude == 0x7C) {
        EXPECT_TRUE(std::isinf(got));
      } else {
        EXPECT_TRUE(std::isnan(got));
      }
    }
  }
}

TEST(Fp8Test, BlockScaleComesFromTheFiniteAbsoluteMaximum) {
  const float e4m3_max = Fp8MaxFinite(Fp8Format::kE4M3FN);
  std::vector<float> block = {1.0f, -896.0f, 3.0f, kInf, kNaN, -kInf, 0.5f};
  EXPECT_EQ(Fp8BlockScale(block, Fp8Format::kE4M3FN), 896.0f / e4m3_max);
  EXPECT_EQ(Fp8BlockScale(block, Fp8Format::kE5M2), 896.0f / 57344.0f);
  // No finite nonzero value: scale 1.
  EXPECT_EQ(Fp8BlockScale(std::vector<float>{0.0f, -0.0f, kInf, kNaN}, Fp8Format::kE4M3FN), 1.0f);
  EXPECT_EQ(Fp8BlockScale(std::vector<float>{}, Fp8Format::kE4M3FN), 1.0f);
  // Never subnormal: tiny blocks get fp32's least normal.
  EXPECT_EQ(Fp8BlockScale(std::vector<float>{1e-40f, -3e-39f}, Fp8Format::kE4M3FN),
            std::numeric_limits<float>::min());
  // Every length around the vector width, the maximum at every position.
  for (size_t n = 1; n <= 40; ++n) {
    for (size_t at = 0; at < n; ++at) {
      std::vector<float> values(n, 0.25f);
      values[at] = -7.0f;
      ASSERT_EQ(Fp8BlockScale(values, Fp8Format::kE5M2), 7.0f / 57344.0f) << n << " " << at;
    }
  }
}

// Random data at many magnitudes, random scales, odd lengths: every kernel
// against the reference, which divides by the scale as the contract says.
TEST(Fp8Test, KernelsMatchTheReferenceAtRandomScales) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> exponent(-30.0f, 30.0f);
  for (Fp8Format format : kFormats) {
    const fp8_reference::Format reference = fp8_reference::MakeFormat(format);
    for (int round = 0; round < 50; ++round) {
      const size_t n = 1 + bits(rng) % 300;
      std::vector<float> values(n);
      for (float& v : values) {
        v = round % 2 == 0 ? std::bit_cast<float>(bits(rng)) : std::exp2(exponent(rng)) * 1.37f;
      }
      const float scale = std::exp2(exponent(rng)) * (1.0f + static_cast<float>(round) / 64.0f);
      for (CastIsa isa : SupportedCastIsas()) {
        std::vector<uint8_t> got(n);
        QuantizeFp8WithScale(values, scale, format, got, isa);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(got[i], fp8_reference::Encode(values[i] / scale, reference))
              << Fp8FormatName(format) << " " << CastIsaName(isa) << " x=" << values[i]
              << " scale=" << scale;
        }
      }
    }
  }
}

TEST(Fp8Test, QuantizeGivesEachBlockItsScaleAndTheLargestValueTheLargestCode) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (Fp8Format format : kFormats) {
    for (size_t block_size : {size_t{32}, size_t{128}, size_t{100}}) {
      const size_t n = 1000;  // a short last block for each size
      std::vector<float> values(n);
      for (float& v : values) v = normal(rng);
      std::vector<uint8_t> codes(n);
      std::vector<float> scales(Fp8BlockCount(n, block_size));
      QuantizeFp8(values, block_size, format, codes, scales);
      for (size_t block = 0; block < scales.size(); ++block) {
        const size_t begin = block * block_size, length = std::min(block_size, n - begin);
        const std::span<const float> piece(values.data() + begin, length);
        ASSERT_EQ(scales[block], Fp8BlockScale(piece, format));
        std::vector<uint8_t> want(length);
        QuantizeFp8WithScale(piece, scales[block], format, want, CastIsa::kScalar);
        ASSERT_TRUE(std::equal(want.begin(), want.end(), codes.begin() + begin));
        const auto largest = std::max_element(piece.begin(), piece.end(), [](float a, float b) {
          return std::fabs(a) < std::fabs(b);
        });
        const uint8_t max_code = format == Fp8Format::kE4M3FN ? 0x7E : 0x7B;
        EXPECT_EQ(codes[begin + (largest - piece.begin())] & 0x7F, max_code);
      }
      // Dequantized, each normal value is within half a step: 2^-4 relative
      // for e4m3fn's 3 mantissa bits, 2^-3 for e5m2's 2 (and the scale's
      // product rounding).
      std::vector<float> back(n);
      DequantizeFp8(codes, block_size, scales, format, back);
      const float bound = format == Fp8Format::kE4M3FN ? 0x1.01p-4f : 0x1.01p-3f;
      for (size_t i = 0; i < n; ++i) {
        const float step = Fp8MaxFinite(format) * scales[i / block_size];
        if (std::fabs(values[i]) < step * (format == Fp8Format::kE4M3FN ? 0x1p-14f : 0x1p-29f)) {
          continue;  // a subnormal of the format: absolute, not relative, precision
        }
        ASSERT_LE(std::fabs(back[i] - values[i]), bound * std::fabs(values[i])) << i;
      }
    }
  }
}

TEST(Fp8Test, SaturatesInfinityAndKeepsNaN) {
  const std::vector<float> values = {kInf, -kInf, kNaN, -kNaN, 1e30f, -1e30f, 0.0f, -0.0f};
  std::vector<uint8_t> e4m3(values.size()), e5m2(values.size());
  for (CastIsa isa : SupportedCastIsas()) {
    QuantizeFp8WithScale(values, 1.0f, Fp8Format::kE4M3FN, e4m3, isa);
    QuantizeFp8WithScale(values, 1.0f, Fp8Format::kE5M2, e5m2, isa);
    EXPECT_THAT(e4m3, testing::ElementsAre(0x7E, 0xFE, 0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80));
    EXPECT_THAT(e5m2, testing::ElementsAre(0x7B, 0xFB, 0x7E, 0xFE, 0x7B, 0xFB, 0x00, 0x80));
  }
}

TEST(Fp8Test, ErrorMeasurementFollowsCastErrorsDefinitions) {
  // One block, scale from 448: 448 exact; 1.0625 between 1 and 1.125 (a tie,
  // to even 1.0: error 0.0625/1.0625); 2^-10 below half the least subnormal
  // (flushed); 2^-7 a subnormal code from a normal fp32; NaN counted only.
  const std::vector<float> values = {448.0f, 1.0625f, 0x1p-11f, 0x1p-7f, kNaN, 0.0f};
  std::vector<uint8_t> codes(values.size());
  std::vector<float> scales(1);
  CastError error;
  QuantizeFp8(values, 128, Fp8Format::kE4M3FN, codes, scales, &error);
  EXPECT_EQ(scales[0], 1.0f);
  EXPECT_EQ(error.elements, 6u);
  EXPECT_EQ(error.measured, 4u);
  EXPECT_EQ(error.overflowed, 0u);
  EXPECT_EQ(error.flushed_to_zero, 1u);
  EXPECT_EQ(error.became_subnormal, 1u);  // 2^-7 (2^-11 became zero, not subnormal)
  EXPECT_EQ(error.max_relative_error, 1.0f);
  EXPECT_NEAR(error.relative_error_sum, 1.0 + 0.0625 / 1.0625, 1e-6);

  // A quotient beyond the saturation point, as only a scale that is not the
  // block's can give: overflowed, not measured.
  CastError saturated;
  std::vector<uint8_t> out(2);
  const std::vector<float> big = {465.0f, 464.0f};
  QuantizeFp8WithScale(big, 1.0f, Fp8Format::kE4M3FN, out);
  MeasureFp8Error(big, out, 1.0f, Fp8Format::kE4M3FN, &saturated);
  EXPECT_EQ(saturated.overflowed, 1u);
  EXPECT_EQ(saturated.measured, 1u);
  EXPECT_TRUE(saturated.Exceeds(1.0f));
}

// The vector kernels find a block's scale in registers and quantize blocks
// with no infinity or NaN by a path of their own: blocks with nothing finite
// and nonzero (scale 1), with only tiny values (fp32's least normal), with
// infinities and NaNs among finite values, of sizes and lengths around the
// vector width.
TEST(Fp8Test, EveryKernelGivesTheScalarOnesScalesAndCodes) {
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> exponent(-20.0f, 20.0f);
  std::vector<float> values(4096);
  for (float& v : values) v = std::exp2(exponent(rng)) * ((rng() & 1) != 0 ? -1.0f : 1.0f);
  std::fill(values.begin() + 256, values.begin() + 512, 0.0f);
  std::fill(values.begin() + 512, values.begin() + 768, -1e-40f);
  std::fill(values.begin() + 768, values.begin() + 1024, kNaN);
  for (size_t i = 1024; i < 1280; i += 2) values[i] = (i % 4 == 0) ? kInf : kNaN;
  for (Fp8Format format : kFormats) {
    for (size_t block_size : {size_t{16}, size_t{128}, size_t{256}, size_t{37}, size_t{7}}) {
      for (size_t n : {values.size(), size_t{1000}, size_t{129}, size_t{15}}) {
        const std::span<const float> input(values.data(), n);
        std::vector<uint8_t> want_codes(n), got_codes(n);
        std::vector<float> want_scales(Fp8BlockCount(n, block_size)), got_scales(want_scales);
        QuantizeFp8(input, block_size, format, want_codes, want_scales, nullptr, CastIsa::kScalar);
        for (CastIsa isa : SupportedCastIsas()) {
          QuantizeFp8(input, block_size, format, got_codes, got_scales, nullptr, isa);
          SCOPED_TRACE(testing::Message() << Fp8FormatName(format) << " " << CastIsaName(isa)
                                          << " block " << block_size << " n " << n);
          ASSERT_EQ(got_scales, want_scales);
          ASSERT_EQ(got_codes, want_codes);
        }
      }
    }
  }
}

// Every kernel's measurement against the scalar one, on blocks holding every
// case (NaN, infinities, zeros, fp32 subnormals, values flushed or made
// subnormal) and lengths that leave tails.
TEST(Fp8Test, EveryKernelMeasuresWhatTheScalarOneDoes) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> exponent(-40.0f, 10.0f);
  std::vector<float> values(5000);
  for (size_t i = 0; i < values.size(); ++i) {
    switch (i % 7) {
      case 0:
        values[i] = std::bit_cast<float>(bits(rng));  // NaNs, infinities, subnormals
        break;
      case 1:
        values[i] = 0.0f;
        break;
      default:
        values[i] = std::exp2(exponent(rng)) * ((bits(rng) & 1) != 0 ? -1.3f : 1.1f);
    }
  }
  // Blocks of fp32 subnormals only: their scale is fp32's least normal, so
  // they quantize to every kind of code, and none became subnormal.
  for (size_t i = 2560; i < 2816; ++i) {
    values[i] = std::bit_cast<float>((bits(rng) & 0x807FFFFF) | 1u);
  }
  for (Fp8Format format : kFormats) {
    for (size_t block_size : {size_t{128}, size_t{37}}) {
      std::vector<uint8_t> codes(values.size());
      std::vector<float> scales(Fp8BlockCount(values.size(), block_size));
      CastError want;
      QuantizeFp8(values, block_size, format, codes, scales, &want, CastIsa::kScalar);
      ASSERT_GT(want.flushed_to_zero, 0u);
      ASSERT_GT(want.became_subnormal, 0u);
      for (CastIsa isa : SupportedCastIsas()) {
        CastError got;
        QuantizeFp8(values, block_size, format, codes, scales, &got, isa);
        SCOPED_TRACE(testing::Message() << Fp8FormatName(format) << " " << CastIsaName(isa));
        EXPECT_EQ(CastErrorDifference(got, want, 1e-5 * want.relative_error_sum), "");
      }
    }
  }
  // A scale that is not the block's saturates; the public measurement runs
  // the widest kernel, which must count it as the definition does.
  const std::vector<float> big = {465.0f, -464.0f, 470.0f, 1.0f, kInf};
  std::vector<uint8_t> out(big.size());
  QuantizeFp8WithScale(big, 1.0f, Fp8Format::kE4M3FN, out, CastIsa::kScalar);
  CastError error;
  MeasureFp8Error(big, out, 1.0f, Fp8Format::kE4M3FN, &error);
  EXPECT_EQ(error.overflowed, 2u);
  EXPECT_EQ(error.measured, 2u);
  EXPECT_EQ(error.elements, 5u);
}

}  // namespace
}  // namespace layercast
