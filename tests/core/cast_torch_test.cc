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

namespace layercast {
namespace {

constexpr char kPython[] = "/usr/bin/python3";

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

template <typename T>
void Write(std::ofstream& out, const std::vector<T>& values) {
  out.write(reinterpret_cast<const char*>(values.data()),
            static_cast<std::streamsize>(values.size() * sizeof(T)));
}

TEST(CastTorchTest, EveryVariantMatchesPyTorchBits) {
  if (std::system(absl::StrCat(kPython, " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
    GTEST_SKIP() << kPython << " cannot import torch (apt install python3-torch); "
                 << "this check against PyTorch's conversions did not run";
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
  const std::string command = absl::StrCat(kPython, " ", LAYERCAST_SOURCE_DIR,
                                           "/tests/core/cast_torch_test.py ", path, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr) << command;
  std::string output;
  char chunk[4096];
  while (size_t n = fread(chunk, 1, sizeof(chunk), pipe)) output.append(chunk, n);
  const int status = pclose(pipe);
  std::remove(path.c_str());
  EXPECT_EQ(status, 0) << command << "\n" << output;
  std::printf("%s", output.c_str());
}

}  // namespace
}  // namespace layercast
