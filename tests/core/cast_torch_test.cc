// Our bits against PyTorch's own conversions, run by tests/core/cast_torch_test.py
// under /usr/bin/python3 (Debian's python3-torch; CI installs it).

#include <gtest/gtest.h>

#include <unistd.h>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "tests/core/torch_check.h"
#include "tests/prerequisite.h"

namespace layercast {
namespace {

using torch_check::kPython;
using torch_check::Write;

// Zeros, subnormals, a tie and its neighbours at every bf16 and fp16
// exponent, the largest finite values and those just past them, infinities,
// NaNs, then random patterns; each with both signs.
std::vector<float> Inputs() {
  std::vector<uint32_t> bits = {0,          1,          0x007FFFFF, 0x00008000, 0x00018000,
                                0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x477FE000,
                                0x477FEFFF, 0x477FF000, 0x477FF001, 0x7F800000, 0x7FC00000,
                                0x7F800001, 0x7FFFFFFF, 0x33000000, 0x33000001, 0x33800000};
  for (uint32_t exponent = 0; exponent < 255; ++exponent) {
    for (uint32_t low : {0x8000u, 0x18000u}) {  // bf16 ties to even and to odd
      const uint32_t tie = exponent << 23 | low;
      bits.insert(bits.end(), {tie - 1, tie, tie + 1});
    }
  }
  for (int exponent = -24; exponent <= 15; ++exponent) {
    for (float mantissa : {1024.5f, 1025.5f, 2047.5f}) {  // fp16 ties, both parities
      const uint32_t tie = std::bit_cast<uint32_t>(std::ldexp(mantissa, exponent - 10));
      bits.insert(bits.end(), {tie - 1, tie, tie + 1});
    }
  }
  std::mt19937 random(42);
  for (int i = 0; i < 100000; ++i) bits.push_back(random());
  std::vector<float> inputs;
  for (uint32_t b : bits)
    inputs.insert(inputs.end(), {std::bit_cast<float>(b), -std::bit_cast<float>(b)});
  return inputs;
}

TEST(CastTorchTest, EveryVariantMatchesPyTorchBits) {
  if (!torch_check::TorchAvailable()) {
    LAYERCAST_PREREQUISITE_MISSING(
        absl::StrCat(kPython,
                     " cannot import torch (apt install python3-torch): no check against PyTorch's "
                     "conversions"));
  }
  const std::vector<float> inputs = Inputs();
  const std::string path = absl::StrCat(::testing::TempDir(), "cast_torch_test_", getpid(), ".bin");
  {
    // Layout (little-endian): u64 count, u64 variants, f32 inputs[count],
    // then per variant u16 bf16[count], u16 f16[count].
    std::ofstream out(path, std::ios::binary);
    const std::vector<uint64_t> header = {inputs.size(), SupportedCastIsas().size()};
    Write(out, header);
    Write(out, inputs);
    for (CastIsa isa : SupportedCastIsas()) {
      std::vector<uint16_t> bf16(inputs.size()), f16(inputs.size());
      CastF32ToBF16(inputs, bf16, isa);
      ASSERT_TRUE(CastF32ToF16(inputs, f16, Fp16Overflow::kInfinity, isa).ok());
      Write(out, bf16);
      Write(out, f16);
    }
    ASSERT_TRUE(out.good()) << path;
  }
  torch_check::RunScript("cast_torch_test.py", path);
}

}  // namespace
}  // namespace layercast
