#include "core/cast_error.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "core/fp8.h"
#include "tests/core/cast_error_expect.h"

namespace layercast {
namespace {

// One of each kind of loss, repeated so the vector kernels' bodies and tails
// both see every kind (kRepeats * 9 = 171 elements: 10 AVX-512 vectors and a
// tail of 11).
constexpr int kRepeats = 19;

std::vector<float> Mixed() {
  const std::vector<float> one = {1.0f,
                                  1.0f + 0x1p-8f,  // bf16 ties to 1.0: 2^-8 / (1 + 2^-8) lost
                                  1e-8f,           // f16: below half its least subnormal
                                  1e-6f,           // f16: subnormal
                                  70000.0f,        // f16: beyond 65504
                                  0.0f,
                                  std::numeric_limits<float>::quiet_NaN(),
                                  -std::numeric_limits<float>::infinity(),
                                  1e-40f};  // an fp32 subnormal: bf16 keeps it, f16 flushes it
  std::vector<float> values;
  for (int r = 0; r < kRepeats; ++r) values.insert(values.end(), one.begin(), one.end());
  return values;
}

// Every count and the maximum exactly; the sum to 1e-6 (kernels add in
// their own order).
void ExpectSameLoss(const CastError& got, const CastError& want) {
  EXPECT_EQ(CastErrorDifference(got, want, 1e-6), "");
}

CastError Measure(const std::vector<float>& in, DType to, Fp16Overflow overflow) {
  std::vector<uint16_t> out(in.size());
  CastError error;
  EXPECT_TRUE(CastFromF32(in.data(), out.data(), in.size(), to, overflow, &error).ok());
  return error;
}

TEST(CastErrorTest, BFloat16LosesOnlyRounding) {
  const CastError error = Measure(Mixed(), DType::kBFloat16, Fp16Overflow::kError);
  EXPECT_EQ(error.elements, 9u * kRepeats);
  EXPECT_EQ(error.measured, 6u * kRepeats);  // all but 0, NaN and -inf
  EXPECT_EQ(error.overflowed, 0u);
  EXPECT_EQ(error.flushed_to_zero, 0u);
  EXPECT_EQ(error.became_subnormal, 0u);  // 1e-40 was subnormal already
  // Normal values lose under 2^-8 (the tie 2^-8 / (1 + 2^-8) the most), the
  // subnormal 1e-40 (0x000116C2, to 0x0001) more: its bf16 has 1 bit.
  EXPECT_EQ(error.above[3], 5u * kRepeats);  // > 2^-10: all but 1.0
  EXPECT_EQ(error.above[4], 1u * kRepeats);  // > 2^-8: the subnormal
  EXPECT_EQ(error.above[7], 0u);
  EXPECT_EQ(error.max_relative_error,
            std::fabs(std::bit_cast<float>(uint32_t{0x00010000}) - 1e-40f) / 1e-40f);
  EXPECT_GT(error.MeanRelativeError(), 0.0);
}

TEST(CastErrorTest, Float16CountsEveryKindOfLoss) {
  for (Fp16Overflow overflow : {Fp16Overflow::kInfinity, Fp16Overflow::kSaturate}) {
    const CastError error = Measure(Mixed(), DType::kFloat16, overflow);
    EXPECT_EQ(error.elements, 9u * kRepeats);
    EXPECT_EQ(error.overflowed, 1u * kRepeats);        // 70000, to inf or to 65504
    EXPECT_EQ(error.measured, 5u * kRepeats);          // overflow is not a relative error
    EXPECT_EQ(error.flushed_to_zero, 2u * kRepeats);   // 1e-8 and 1e-40
    EXPECT_EQ(error.became_subnormal, 1u * kRepeats);  // 1e-6 (1e-40 was subnormal already)
    EXPECT_EQ(error.max_relative_error, 1.0f);         // flushed: all of it
    EXPECT_EQ(error.above[CastError::kBuckets - 1], 2u * kRepeats);
    EXPECT_EQ(error.Describe(),
              "171 elements: max relative error 1, mean 0.403; 38 flushed to zero, 19 "
              "overflowed, 19 became subnormal");
  }
}

TEST(CastErrorTest, EveryKernelAndEveryLengthCountsTheSame) {
  const std::vector<float> in = Mixed();
  for (DType to : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<uint16_t> out(in.size());
    ASSERT_TRUE(CastFromF32(in.data(), out.data(), in.size(), to, Fp16Overflow::kInfinity).ok());
    for (size_t n = 0; n <= in.size(); n += 7) {
      CastError scalar;
      MeasureCastError(in.data(), out.data(), n, to, &scalar, CastIsa::kScalar);
      for (CastIsa isa : SupportedCastIsas()) {
        SCOPED_TRACE(testing::Message() << DTypeName(to) << " " << CastIsaName(isa) << " n=" << n);
        CastError got;
        MeasureCastError(in.data(), out.data(), n, to, &got, isa);
        EXPECT_EQ(got.elements, n);
        ExpectSameLoss(got, scalar);
      }
    }
  }
}

TEST(CastErrorTest, AnUnalignedDestinationMeasuresTheSame) {
  const std::vector<float> in = Mixed();
  std::vector<unsigned char> out(in.size() * 2 + 1);
  CastError aligned, odd;
  ASSERT_TRUE(CastFromF32(in.data(), out.data(), in.size(), DType::kFloat16,
                          Fp16Overflow::kSaturate, &aligned)
                  .ok());
  ASSERT_TRUE(CastFromF32(in.data(), out.data() + 1, in.size(), DType::kFloat16,
                          Fp16Overflow::kSaturate, &odd)
                  .ok());
  EXPECT_EQ(odd.Describe(), aligned.Describe());
  EXPECT_EQ(odd.above, aligned.above);
}

TEST(CastErrorTest, ACopyToFloat32OnlyCounts) {
  const std::vector<float> in = Mixed();
  std::vector<float> out(in.size());
  CastError error;
  ASSERT_TRUE(
      CastFromF32(in.data(), out.data(), in.size(), DType::kFloat32, Fp16Overflow::kError, &error)
          .ok());
  EXPECT_EQ(error.elements, in.size());
  EXPECT_EQ(error.measured, 0u);
  EXPECT_EQ(error.max_relative_error, 0.0f);
}

// A cast that fails at an overflow adds nothing: the failing part may be
// partly unwritten, and a shard does not serve it.
TEST(CastErrorTest, AFailedCastLeavesTheErrorAsItWas) {
  std::vector<float> in(10000, 1.5f);
  in[9000] = 1e6f;
  std::vector<unsigned char> out(in.size() * 2 + 1);
  for (size_t offset : {0, 1}) {  // the one-pass cast and the bounced pieces
    SCOPED_TRACE(testing::Message() << "destination offset " << offset);
    CastError error;
    error.elements = 7;
    error.max_relative_error = 0.5f;
    const absl::Status status = CastFromF32(in.data(), out.data() + offset, in.size(),
                                            DType::kFloat16, Fp16Overflow::kError, &error);
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
    EXPECT_THAT(status.message(), testing::HasSubstr("element 9000 is 1e+06"));
    EXPECT_EQ(error.elements, 7u);
    EXPECT_EQ(error.measured, 0u);
    EXPECT_EQ(error.max_relative_error, 0.5f);
  }
}

// The cast that measures as it goes works up to the source's cache line
// boundary first and two vectors a turn after that: at every length and
// source offset it writes the plain cast's bits and measures what the
// scalar kernel measures from them.
TEST(CastErrorTest, TheMeasuringCastMatchesThePlainCastAtEveryOffsetAndLength) {
  const std::vector<float> once = Mixed();
  std::vector<float> mixed = once;
  mixed.insert(mixed.end(), once.begin(), once.end());  // 342: over 16 AVX-512 vectors
  for (DType to : {DType::kBFloat16, DType::kFloat16}) {
    for (size_t offset = 0; offset < 16; ++offset) {
      for (size_t n = 0; n + offset <= mixed.size(); n += n < 80 ? 1 : 37) {
        SCOPED_TRACE(testing::Message() << DTypeName(to) << " offset " << offset << " n " << n);
        const float* in = mixed.data() + offset;
        std::vector<uint16_t> plain(n), measuring(n);
        ASSERT_TRUE(CastFromF32(in, plain.data(), n, to, Fp16Overflow::kSaturate).ok());
        CastError want, got;
        MeasureCastError(in, plain.data(), n, to, &want, CastIsa::kScalar);
        ASSERT_TRUE(CastFromF32(in, measuring.data(), n, to, Fp16Overflow::kSaturate, &got).ok());
        ASSERT_EQ(measuring, plain);
        EXPECT_EQ(got.elements, n);
        ExpectSameLoss(got, want);
      }
    }
  }
}

TEST(CastErrorTest, AddSumsAndKeepsTheLargestError) {
  CastError a, b;
  a.elements = 3;
  a.measured = 2;
  a.relative_error_sum = 0.5;
  a.max_relative_error = 0.25f;
  a.above[0] = 2;
  b.elements = 4;
  b.measured = 4;
  b.flushed_to_zero = 1;
  b.relative_error_sum = 1.5;
  b.max_relative_error = 1.0f;
  b.above[0] = 1;
  a.Add(b);
  EXPECT_EQ(a.elements, 7u);
  EXPECT_EQ(a.measured, 6u);
  EXPECT_EQ(a.flushed_to_zero, 1u);
  EXPECT_EQ(a.above[0], 3u);
  EXPECT_EQ(a.max_relative_error, 1.0f);
  EXPECT_DOUBLE_EQ(a.MeanRelativeError(), 2.0 / 6);
}

TEST(CastErrorTest, ExceedsABoundByALargerErrorOrAnyOverflow) {
  CastError error;
  error.max_relative_error = 0x1p-9f;
  EXPECT_FALSE(error.Exceeds(0x1p-9f)) << "a bound is inclusive";
  EXPECT_TRUE(error.Exceeds(0x1p-10f));
  error.overflowed = 1;
  EXPECT_TRUE(error.Exceeds(1.0f)) << "an overflow exceeds every bound";
}

// A trained model's values (normal, well inside every dtype's range) with
// rare elements planted at random places: values that flush, become
// subnormal or overflow in the dtype (and for fp8 under the block's scale),
// zeros, NaNs and infinities.
std::vector<float> WithPlantedRareElements(size_t n, uint32_t seed) {
  std::mt19937 random(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::uniform_int_distribution<size_t> where(0, n - 1);
  std::vector<float> values(n);
  for (float& x : values) x = normal(random);
  const float rare[] = {1e-8f,
                        1e-6f,
                        70000.0f,
                        0.0f,
                        1e-40f,
                        3e-5f,
                        -2e-9f,
                        std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity()};
  for (int planted = 0; planted < 40; ++planted) values[where(random)] = rare[planted % 9];
  return values;
}

bool SamplesOnThisCpu() {
  const std::vector<CastIsa>& isas = SupportedCastIsas();
  return std::find(isas.begin(), isas.end(), CastIsa::kAvx512) != isas.end();
}

// What a sampled measurement must get exactly as one of every element:
// the counts, the maximum (planted rare elements put it beyond the unit
// roundoff), and so the verdict of every bound at or above the roundoff.
void ExpectExactWhereItMatters(const CastError& sampled, const CastError& exact, DType dtype,
                               const std::string& label) {
  EXPECT_EQ(sampled.elements, exact.elements) << label;
  EXPECT_EQ(sampled.overflowed, exact.overflowed) << label;
  EXPECT_EQ(sampled.flushed_to_zero, exact.flushed_to_zero) << label;
  EXPECT_EQ(sampled.became_subnormal, exact.became_subnormal) << label;
  EXPECT_EQ(sampled.measured + sampled.unmeasured, exact.measured) << label;
  EXPECT_GT(exact.max_relative_error, RelativeErrorBound(dtype)) << label << ": planted";
  EXPECT_EQ(sampled.max_relative_error, exact.max_relative_error) << label;
  for (const float bound : {RelativeErrorBound(dtype), 2 * RelativeErrorBound(dtype), 0.01f, 0.1f,
                            0.5f, exact.max_relative_error}) {
    EXPECT_EQ(sampled.Exceeds(bound), exact.Exceeds(bound)) << label << ", bound " << bound;
  }
}

// Sampled, every rare element is still measured: the counts of lost
// elements are exact, the maximum too wherever it is beyond the dtype's
// unit roundoff, so a policy's max_rel_error at or above the roundoff
// refuses exactly the casts an exact measurement refuses.
TEST(CastErrorTest, ASampleMeasuresEveryRareElementAndGatesExactly) {
  for (const DType to : {DType::kBFloat16, DType::kFloat16}) {
    for (const uint32_t seed : {1u, 2u, 3u}) {
      const std::vector<float> in = WithPlantedRareElements(1 << 16, seed);
      std::vector<uint16_t> out(in.size());
      CastError exact, sampled;
      sampled.sample_every = 64;
      ASSERT_TRUE(
          CastFromF32(in.data(), out.data(), in.size(), to, Fp16Overflow::kSaturate, &exact).ok());
      ASSERT_TRUE(
          CastFromF32(in.data(), out.data(), in.size(), to, Fp16Overflow::kSaturate, &sampled)
              .ok());
      const std::string label = absl::StrCat(DTypeName(to), ", seed ", seed);
      ExpectExactWhereItMatters(sampled, exact, to, label);
      if (SamplesOnThisCpu()) {
        EXPECT_TRUE(sampled.sampled()) << label;
        // One vector in 64 of those that stay normal, and every one holding
        // a rare element (for float16, also the 0.2% of these values below
        // its least normal, 2^-14: a vector in 25).
        EXPECT_LT(sampled.measured, exact.measured / 8) << label;
      }
    }
  }
}

// The same for the 8-bit floats, whose normal range follows each block's
// scale.
TEST(CastErrorTest, AnFp8SampleMeasuresEveryRareElementAndGatesExactly) {
  for (const Fp8Format format : {Fp8Format::kE4M3FN, Fp8Format::kE5M2}) {
    const DType dtype = format == Fp8Format::kE4M3FN ? DType::kFloat8E4M3FN : DType::kFloat8E5M2;
    std::vector<float> in = WithPlantedRareElements(1 << 16, 7);
    // Below the least normal code under a block's scale: 2^-7 of a block's
    // largest value is subnormal in e4m3fn, 2^-15 in e5m2.
    for (size_t i = 300; i < in.size(); i += 4099) in[i] = 1e-6f;
    std::vector<uint8_t> codes(in.size());
    std::vector<float> scales(Fp8BlockCount(in.size(), 128));
    CastError exact, sampled;
    sampled.sample_every = 64;
    QuantizeFp8(in, 128, format, codes, scales, &exact);
    QuantizeFp8(in, 128, format, codes, scales, &sampled);
    const std::string label(Fp8FormatName(format));
    ExpectExactWhereItMatters(sampled, exact, dtype, label);
    if (SamplesOnThisCpu()) {
      EXPECT_TRUE(sampled.sampled()) << label;
      EXPECT_LT(sampled.measured, exact.measured / 8) << label;
    }
  }
}

// Whatever the sample, no element of the normal range loses more than the
// unit roundoff: measured exactly, the largest such loss is within it.
TEST(CastErrorTest, TheNormalRangeLosesAtMostTheUnitRoundoff) {
  std::mt19937 random(4);
  std::uniform_real_distribution<float> exponent(-14.0f, 15.0f);
  std::vector<float> in(1 << 16);
  for (float& x : in) x = std::exp2(exponent(random)) * (random() % 2 == 0 ? 1.0f : -1.0f);
  for (const DType to : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<uint16_t> out(in.size());
    CastError error;
    ASSERT_TRUE(
        CastFromF32(in.data(), out.data(), in.size(), to, Fp16Overflow::kError, &error).ok());
    EXPECT_EQ(error.became_subnormal + error.flushed_to_zero + error.overflowed, 0u);
    EXPECT_LE(error.max_relative_error, RelativeErrorBound(to)) << DTypeName(to);
    EXPECT_GT(error.max_relative_error, RelativeErrorBound(to) / 2) << DTypeName(to);
  }
  for (const Fp8Format format : {Fp8Format::kE4M3FN, Fp8Format::kE5M2}) {
    const DType dtype = format == Fp8Format::kE4M3FN ? DType::kFloat8E4M3FN : DType::kFloat8E5M2;
    // Within a block's normal range: magnitudes within 2^5 of each other.
    std::uniform_real_distribution<float> near(0.0f, 5.0f);
    std::vector<float> block_values(in.size());
    for (float& x : block_values) x = std::exp2(near(random));
    std::vector<uint8_t> codes(in.size());
    std::vector<float> scales(Fp8BlockCount(in.size(), 32));
    CastError error;
    QuantizeFp8(block_values, 32, format, codes, scales, &error);
    EXPECT_EQ(error.became_subnormal + error.flushed_to_zero, 0u) << Fp8FormatName(format);
    EXPECT_LE(error.max_relative_error, RelativeErrorBound(dtype)) << Fp8FormatName(format);
  }
}

}  // namespace
}  // namespace layercast
