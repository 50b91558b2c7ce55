#include "core/cast.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <Eigen/Core>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/cast_kernels.h"

namespace layercast {
namespace {

float F(uint32_t bits) { return std::bit_cast<float>(bits); }
uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

struct Case {
  float in;
  uint16_t want;
};

std::string Describe(const Case& c) {
  return absl::StrFormat("fp32 0x%08x (%g)", Bits(c.in), c.in);
}

std::vector<float> Inputs(const std::vector<Case>& cases) {
  std::vector<float> in;
  for (const Case& c : cases) in.push_back(c.in);
  return in;
}

// Each case both alone (the tail path) and in one long array (the vector body).
void ExpectBF16(const std::vector<Case>& cases, CastIsa isa) {
  const std::vector<float> in = Inputs(cases);
  std::vector<uint16_t> out(in.size());
  CastF32ToBF16(in, out, isa);
  for (size_t i = 0; i < cases.size(); ++i) {
    uint16_t alone;
    CastF32ToBF16({&cases[i].in, 1}, {&alone, 1}, isa);
    EXPECT_EQ(alone, cases[i].want) << Describe(cases[i]) << " alone";
    EXPECT_EQ(out[i], cases[i].want) << Describe(cases[i]) << " at index " << i;
  }
}

void ExpectF16(const std::vector<Case>& cases, Fp16Overflow overflow, CastIsa isa) {
  const std::vector<float> in = Inputs(cases);
  std::vector<uint16_t> out(in.size());
  ASSERT_TRUE(CastF32ToF16(in, out, overflow, isa).ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    uint16_t alone;
    ASSERT_TRUE(CastF32ToF16({&cases[i].in, 1}, {&alone, 1}, overflow, isa).ok());
    EXPECT_EQ(alone, cases[i].want) << Describe(cases[i]) << " alone";
    EXPECT_EQ(out[i], cases[i].want) << Describe(cases[i]) << " at index " << i;
  }
}

// Both signs of each case.
std::vector<Case> Signed(std::vector<Case> cases) {
  const size_t n = cases.size();
  for (size_t i = 0; i < n; ++i) {
    cases.push_back({-cases[i].in, static_cast<uint16_t>(cases[i].want | 0x8000)});
  }
  return cases;
}

// The exact value of a finite float16, computed without any float16 code.
double F16Value(uint16_t h) {
  const int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  return exponent == 0 ? std::ldexp(mantissa, -24) : std::ldexp(1024 + mantissa, exponent - 25);
}

class CastIsaTest : public ::testing::TestWithParam<CastIsa> {};

INSTANTIATE_TEST_SUITE_P(CastIsas, CastIsaTest, ::testing::ValuesIn(SupportedCastIsas()),
                         [](const auto& info) { return std::string(CastIsaName(info.param)); });

TEST(CastTest, VariantsAreListedScalarFirstAndTheWidestOfTheFastestIsUsed) {
  EXPECT_EQ(CastIsaName(CastIsa::kScalar), "scalar");
  EXPECT_EQ(CastIsaName(CastIsa::kAvx2), "avx2");
  EXPECT_EQ(CastIsaName(CastIsa::kAvx512), "avx512");
  EXPECT_EQ(CastIsaName(CastIsa::kAvx512Bf16), "avx512bf16");
  for (CastIsa isa : {CastIsa::kScalar, CastIsa::kAvx2, CastIsa::kAvx512, CastIsa::kAvx512Bf16}) {
    EXPECT_EQ(*CastIsaFromName(CastIsaName(isa)), isa);
  }
  EXPECT_EQ(CastIsaFromName("avx1024").status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_FALSE(SupportedCastIsas().empty());
  EXPECT_EQ(SupportedCastIsas().front(), CastIsa::kScalar);
  // Each cast runs what the table gives this CPU, the same on every call.
  const CastIsaSelection& selection = SelectedCastIsa();
  EXPECT_FALSE(selection.chosen);
  ASSERT_EQ(selection.choices.size(), std::size(kCastKinds));
  EXPECT_FALSE(selection.cpu.empty());
  EXPECT_FALSE(selection.row.empty());
  for (const CastIsaSelection::Choice& choice : selection.choices) {
    SCOPED_TRACE(CastKindName(choice.kind));
    EXPECT_NE(std::find(SupportedCastIsas().begin(), SupportedCastIsas().end(), choice.isa),
              SupportedCastIsas().end());
    EXPECT_EQ(BestCastIsa(choice.kind), choice.isa);
    EXPECT_EQ(selection.For(choice.kind), choice.isa);
  }
  EXPECT_THAT(selection.Describe(), ::testing::HasSubstr(selection.cpu));
  // The build-info label names each cast's variant, or the one they share.
  const std::string summary = selection.Summary();
  for (const CastIsaSelection::Choice& choice : selection.choices) {
    EXPECT_THAT(summary, ::testing::HasSubstr(CastIsaName(choice.isa)));
  }
  EXPECT_EQ(ChooseCastIsa(CastIsa::kScalar).code(), absl::StatusCode::kFailedPrecondition)
      << "picked already: too late to choose";
}

// The choice is a function of the CPU's model and features alone: a row's
// preference where the CPU runs it, else the widest narrower variant it
// runs; the widest it runs where no row names it.
TEST(CastTest, DispatchIsAFunctionOfTheCpuModel) {
  using internal::CpuModel;
  using internal::SelectFor;
  const CastIsa scalar = CastIsa::kScalar, avx2 = CastIsa::kAvx2, avx512 = CastIsa::kAvx512,
                bf16 = CastIsa::kAvx512Bf16;
  const auto isas = [](const CastIsaSelection& s) {
    std::vector<CastIsa> out;
    for (const auto& c : s.choices) out.push_back(c.isa);
    return out;
  };
  const CpuModel zen5{.vendor = "AuthenticAMD", .family = 0x1a, .model = 0x02};
  const CastIsaSelection on_zen5 = SelectFor(zen5, {scalar, avx2, avx512, bf16});
  EXPECT_EQ(on_zen5.row, "AMD Zen 5");
  EXPECT_EQ(on_zen5.cpu, "AuthenticAMD family 0x1a model 0x2");
  EXPECT_EQ(isas(on_zen5), (std::vector<CastIsa>{bf16, avx512, avx512, avx512}));
  EXPECT_EQ(on_zen5.Summary(),
            "f32_to_bf16=avx512bf16,f32_to_f16=avx512,bf16_to_f32=avx512,f16_to_f32=avx512");
  // The same inputs, the same answer: nothing is timed.
  EXPECT_EQ(isas(SelectFor(zen5, {scalar, avx2, avx512, bf16})), isas(on_zen5));
  // A row's CPU without the preferred variant (a hypervisor hiding AVX-512).
  EXPECT_EQ(isas(SelectFor(zen5, {scalar, avx2})), (std::vector<CastIsa>{avx2, avx2, avx2, avx2}));
  // No row: the widest it runs, at every cast.
  const CpuModel intel{.vendor = "GenuineIntel", .family = 6, .model = 0x8f};
  const CastIsaSelection on_intel = SelectFor(intel, {scalar, avx2, avx512, bf16});
  EXPECT_EQ(isas(on_intel), (std::vector<CastIsa>{bf16, bf16, bf16, bf16}));
  EXPECT_EQ(on_intel.Summary(), "avx512bf16");
  EXPECT_EQ(isas(SelectFor(intel, {scalar, avx2, avx512})),
            (std::vector<CastIsa>{avx512, avx512, avx512, avx512}));
  EXPECT_EQ(isas(SelectFor(CpuModel{}, {scalar})),
            (std::vector<CastIsa>{scalar, scalar, scalar, scalar}));
  EXPECT_THAT(SelectFor(CpuModel{}, {scalar}).Describe(), ::testing::HasSubstr("unknown vendor"));
}

TEST_P(CastIsaTest, BF16KeepsZerosAndSubnormals) {
  ExpectBF16(Signed({{0.0f, 0x0000},
                     {F(0x00000001), 0x0000},  // smallest fp32 subnormal: below half a bf16 ulp
                     {F(0x00008001), 0x0001},
                     {F(0x00010000), 0x0001},  // smallest bf16 subnormal, kept
                     {F(0x00400000), 0x0040},
                     {F(0x007F0000), 0x007F},    // largest bf16 subnormal
                     {F(0x007FFFFF), 0x0080}}),  // largest fp32 subnormal rounds up to normal
             GetParam());
}

TEST_P(CastIsaTest, BF16RoundsEveryTieToEven) {
  std::vector<Case> cases;
  for (uint32_t low = 0; low < 0x7F80; ++low) {
    const uint32_t tie = (low << 16) | 0x8000;  // halfway between low and low + 1
    cases.push_back({F(tie), static_cast<uint16_t>(low + (low & 1))});
    cases.push_back({F(tie - 1), static_cast<uint16_t>(low)});
    cases.push_back({F(tie + 1), static_cast<uint16_t>(low + 1)});
  }
  ExpectBF16(Signed(cases), GetParam());
}

TEST_P(CastIsaTest, BF16KeepsInfinitiesAndQuietsNaNs) {
  ExpectBF16(Signed({{F(0x7F7F0000), 0x7F7F},  // largest bf16
                     {F(0x7F7F7FFF), 0x7F7F},
                     {FLT_MAX, 0x7F80},  // rounds to infinity, as PyTorch does
                     {INFINITY, 0x7F80},
                     {F(0x7FC00000), 0x7FC0},
                     {F(0x7F800001), 0x7FC0},  // signalling
                     {F(0x7F80FFFF), 0x7FC0},  // truncation would make this inf
                     {F(0x7FFFFFFF), 0x7FC0}}),
             GetParam());
}

TEST_P(CastIsaTest, WideningKeepsNaNPayloadsAndSigns) {
  const std::vector<uint16_t> bf16 = {0x7F81, 0xFFC1, 0x7F80, 0x0001};
  const std::vector<uint16_t> f16 = {0x7C01, 0xFE01, 0x7C00, 0x0001};
  std::vector<float> wide(bf16.size());
  CastBF16ToF32(bf16, wide, GetParam());
  EXPECT_EQ(Bits(wide[0]), 0x7F810000u);  // a signalling NaN stays as it is
  EXPECT_EQ(Bits(wide[1]), 0xFFC10000u);
  EXPECT_EQ(Bits(wide[2]), 0x7F800000u);
  EXPECT_EQ(Bits(wide[3]), 0x00010000u);
  CastF16ToF32(f16, wide, GetParam());
  EXPECT_EQ(Bits(wide[0]), 0x7FC02000u);  // quietened, as VCVTPH2PS does
  EXPECT_EQ(Bits(wide[1]), 0xFFC02000u);
  EXPECT_EQ(Bits(wide[2]), 0x7F800000u);
  EXPECT_EQ(wide[3], std::ldexp(1.0f, -24));
}

TEST_P(CastIsaTest, F16KeepsZerosAndSubnormals) {
  ExpectF16(Signed({{0.0f, 0x0000},
                    {F(0x00000001), 0x0000},          // smallest fp32 subnormal
                    {F(0x007FFFFF), 0x0000},          // largest fp32 subnormal
                    {std::ldexp(1.0f, -25), 0x0000},  // tie between 0 and the smallest: even
                    {F(Bits(std::ldexp(1.0f, -25)) + 1), 0x0001},
                    {std::ldexp(1.0f, -24), 0x0001},         // smallest fp16 subnormal
                    {1023 * std::ldexp(1.0f, -24), 0x03FF},  // largest fp16 subnormal
                    {1023.5f * std::ldexp(1.0f, -24), 0x0400},
                    {std::ldexp(1.0f, -14), 0x0400}}),  // smallest fp16 normal
            Fp16Overflow::kError, GetParam());
}

TEST_P(CastIsaTest, F16RoundsEveryTieToEven) {
  std::vector<Case> cases;
  for (uint16_t low = 0; low < 0x7BFF; ++low) {
    const auto tie = static_cast<float>((F16Value(low) + F16Value(low + 1)) / 2);  // exact
    cases.push_back({tie, static_cast<uint16_t>(low + (low & 1))});
    cases.push_back({F(Bits(tie) - 1), low});
    cases.push_back({F(Bits(tie) + 1), static_cast<uint16_t>(low + 1)});
  }
  ExpectF16(Signed(cases), Fp16Overflow::kError, GetParam());
}

TEST_P(CastIsaTest, F16OverflowFollowsTheRule) {
  const std::vector<Case> finite = {{65504.0f, 0x7BFF}, {F(0x477FEFFF), 0x7BFF}};
  const std::vector<float> beyond = {65520.0f, 70000.0f, 1e10f, FLT_MAX};  // 65520: tie to odd
  const std::vector<Case> special = {{INFINITY, 0x7C00},
                                     {NAN, 0x7E00},
                                     {F(0x7F800001), 0x7E00},  // truncation would make this inf
                                     {F(0x7FFFFFFF), 0x7E00}};
  std::vector<Case> saturate = finite, infinity = finite;
  for (float f : beyond) {
    saturate.push_back({f, 0x7BFF});
    infinity.push_back({f, 0x7C00});
  }
  for (const Case& c : special) {
    saturate.push_back(c);
    infinity.push_back(c);
  }
  ExpectF16(Signed(saturate), Fp16Overflow::kSaturate, GetParam());
  ExpectF16(Signed(infinity), Fp16Overflow::kInfinity, GetParam());
  ExpectF16(Signed(special), Fp16Overflow::kError, GetParam());  // inf and NaN are no overflow
}

TEST_P(CastIsaTest, F16ErrorNamesTheFirstOffender) {
  for (size_t size = 1; size <= 67; ++size) {
    for (size_t at = 0; at < size; ++at) {
      std::vector<float> in(size, 1.0f);
      in[at] = at % 2 ? 70000.0f : -70000.0f;
      if (at + 1 < size) in[at + 1] = 1e10f;
      std::vector<uint16_t> out(size);
      const absl::Status status = CastF32ToF16(in, out, Fp16Overflow::kError, GetParam());
      ASSERT_EQ(status.code(), absl::StatusCode::kOutOfRange) << size << " " << at;
      ASSERT_EQ(
          status.message(),
          absl::StrFormat("element %d is %s70000, beyond float16's largest finite value 65504", at,
                          at % 2 ? "" : "-"));
    }
  }
}

// Random patterns (NaNs, infinities and overflows included) at every length
// up to a few vectors, starting one element in so the vectors are unaligned;
// nothing outside [begin, begin + size) may be written.
// Element `offset` past the first 64-byte boundary in `buffer`, which holds
// at least 64 bytes more than is used from there.
template <typename T>
T* PastLine(std::vector<T>& buffer, size_t offset) {
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - address % 64) % 64) / sizeof(T) + offset;
}

// Every length up to a few vectors, starting at every 4-byte offset from a
// cache line: the vector kernels work up to a line boundary first.
TEST_P(CastIsaTest, EveryLengthConvertsAllAndOnlyItsElements) {
  constexpr uint16_t kCanary16 = 0xDEAD;
  constexpr float kCanary32 = -12345.0f;
  std::mt19937 random(7);
  for (size_t offset = 0; offset < 16; ++offset) {
    for (size_t size = 0; size <= 67; ++size) {
      SCOPED_TRACE(
          absl::StrFormat("%zu elements, fp32 side %zu elements past a cache line", size, offset));
      // Canaries at [0] and [size + 1] of each view.
      std::vector<float> in(size + 2 + 32), wide_buffer(size + 2 + 32);
      std::vector<uint16_t> narrow_buffer(size + 2 + 64);
      float* const in_view = PastLine(in, offset);
      float* const wide = PastLine(wide_buffer, offset);
      uint16_t* const narrow = PastLine(narrow_buffer, (offset * 7) % 32);
      for (size_t i = 0; i < size + 2; ++i) in_view[i] = F(random());
      const std::span<const float> src(in_view + 1, size);
      const std::span<uint16_t> narrow_span(narrow + 1, size);
      const std::span<float> wide_span(wide + 1, size);

      std::fill(narrow, narrow + size + 2, kCanary16);
      CastF32ToBF16(src, narrow_span, GetParam());
      EXPECT_EQ(narrow[0], kCanary16);
      EXPECT_EQ(narrow[size + 1], kCanary16);
      for (size_t i = 0; i < size; ++i) {
        const uint16_t want = std::isnan(src[i]) ? (Bits(src[i]) >> 16 & 0x8000) | 0x7FC0
                                                 : std::bit_cast<uint16_t>(Eigen::bfloat16(src[i]));
        EXPECT_EQ(narrow[i + 1], want) << Describe({src[i], 0});
      }
      std::fill(wide, wide + size + 2, kCanary32);
      CastBF16ToF32(narrow_span, wide_span, GetParam());
      EXPECT_EQ(wide[0], kCanary32);
      EXPECT_EQ(wide[size + 1], kCanary32);
      for (size_t i = 0; i < size; ++i) EXPECT_EQ(Bits(wide[i + 1]), uint32_t{narrow[i + 1]} << 16);

      std::fill(narrow, narrow + size + 2, kCanary16);
      ASSERT_TRUE(CastF32ToF16(src, narrow_span, Fp16Overflow::kInfinity, GetParam()).ok());
      EXPECT_EQ(narrow[0], kCanary16);
      EXPECT_EQ(narrow[size + 1], kCanary16);
      for (size_t i = 0; i < size; ++i) {
        const uint16_t want = std::isnan(src[i]) ? (Bits(src[i]) >> 16 & 0x8000) | 0x7E00
                                                 : std::bit_cast<uint16_t>(Eigen::half(src[i]));
        EXPECT_EQ(narrow[i + 1], want) << Describe({src[i], 0});
      }
      std::fill(wide, wide + size + 2, kCanary32);
      CastF16ToF32(narrow_span, wide_span, GetParam());
      EXPECT_EQ(wide[0], kCanary32);
      EXPECT_EQ(wide[size + 1], kCanary32);
      for (size_t i = 0; i < size; ++i) {
        const auto want = static_cast<float>(std::bit_cast<Eigen::half>(narrow[i + 1]));
        if (!std::isnan(want)) {
          EXPECT_EQ(Bits(wide[i + 1]), Bits(want));
        }
      }
    }
  }
}

// kError stops at the first overflowing element wherever it lies: in the
// head a kernel works up to a cache line, in its vectors, or in the tail.
TEST_P(CastIsaTest, F16ErrorFindsTheOffenderAtEveryOffset) {
  std::vector<float> buffer(128 + 16, 1.5f);
  std::vector<uint16_t> out(128 + 16);
  for (size_t offset = 0; offset < 16; ++offset) {
    for (size_t bad = 0; bad < 100; ++bad) {
      float* const src = PastLine(buffer, offset);
      std::fill(src, src + 100, 1.5f);
      src[bad] = 70000.0f;
      if (bad + 1 < 100) src[bad + 1] = -80000.0f;  // a later one is not named
      const absl::Status status =
          CastF32ToF16({src, 100}, {out.data(), 100}, Fp16Overflow::kError, GetParam());
      EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
      EXPECT_THAT(std::string(status.message()),
                  ::testing::StartsWith(absl::StrCat("element ", bad, " is 70000")))
          << "offset " << offset;
    }
  }
}

TEST(CastTest, F16RefusesMismatchedSizes) {
  std::vector<float> in(3);
  std::vector<uint16_t> out(2);
  EXPECT_EQ(CastF32ToF16(in, out, Fp16Overflow::kSaturate).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CastTest, EmptyInputsAreFine) {
  CastF32ToBF16({}, {});
  EXPECT_TRUE(CastF32ToF16({}, {}, Fp16Overflow::kError).ok());
  CastBF16ToF32({}, {});
  CastF16ToF32({}, {});
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    EXPECT_TRUE(CastFromF32(nullptr, nullptr, 0, dtype, Fp16Overflow::kError).ok());
    CastToF32(nullptr, dtype, nullptr, 0);
  }
}

// More elements than CastFromF32's bounce buffer holds, at an odd address.
TEST(CastTest, CastFromF32AndToF32HandleUnalignedBuffers) {
  constexpr size_t kCount = 5000;
  std::vector<float> in(kCount);
  std::mt19937 random(11);
  std::uniform_real_distribution<float> values(-70000.0f, 70000.0f);
  for (float& f : in) f = values(random);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const size_t bytes = kCount * DTypeSize(dtype);
    std::vector<unsigned char> aligned(bytes), unaligned(bytes + 1);
    ASSERT_TRUE(
        CastFromF32(in.data(), aligned.data(), kCount, dtype, Fp16Overflow::kSaturate).ok());
    ASSERT_TRUE(
        CastFromF32(in.data(), unaligned.data() + 1, kCount, dtype, Fp16Overflow::kSaturate).ok());
    EXPECT_EQ(std::memcmp(aligned.data(), unaligned.data() + 1, bytes), 0);
    if (dtype == DType::kBFloat16) {
      std::vector<uint16_t> want(kCount);
      CastF32ToBF16(in, want);
      EXPECT_EQ(std::memcmp(aligned.data(), want.data(), bytes), 0);
    }

    std::vector<float> from_aligned(kCount), from_unaligned(kCount);
    CastToF32(aligned.data(), dtype, from_aligned.data(), kCount);
    CastToF32(unaligned.data() + 1, dtype, from_unaligned.data(), kCount);
    EXPECT_EQ(std::memcmp(from_aligned.data(), from_unaligned.data(), kCount * sizeof(float)), 0);
    if (dtype == DType::kFloat32) {
      EXPECT_EQ(from_aligned, in);
    }
  }
}

TEST(CastTest, CastFromF32NamesTheOffenderPastTheBounceBuffer) {
  std::vector<float> in(5000, 2.0f);
  in[4321] = -65520.0f;
  in[4800] = 70000.0f;
  std::vector<unsigned char> out(in.size() * 2 + 1);
  for (size_t offset : {0, 1}) {
    const absl::Status status = CastFromF32(in.data(), out.data() + offset, in.size(),
                                            DType::kFloat16, Fp16Overflow::kError);
    EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
    EXPECT_EQ(status.message(),
              "element 4321 is -65520, beyond float16's largest finite value 65504");
  }
}

}  // namespace
}  // namespace layercast
