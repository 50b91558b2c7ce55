#include "core/crc32c.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace layercast {
namespace {

TEST(Crc32cTest, KnownVectors) {
  // RFC 3720 (iSCSI) appendix B.4 and the usual check value.
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  const std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  std::vector<uint8_t> ascending(32);
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(Crc32c(ascending.data(), ascending.size()), 0x46DD794Eu);
  EXPECT_EQ(Crc32c("", 0), 0u);
}

TEST(Crc32cTest, ContinuesAcrossPiecesAtAnySplit) {
  std::mt19937 rng(5);
  std::vector<uint8_t> data(1000);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  const uint32_t whole = Crc32c(data.data(), data.size());
  for (size_t split : {0, 1, 7, 8, 9, 500, 999, 1000}) {
    EXPECT_EQ(Crc32c(data.data() + split, data.size() - split, Crc32c(data.data(), split)), whole)
        << split;
  }
  data[123] ^= 1;
  EXPECT_NE(Crc32c(data.data(), data.size()), whole);
}

// Bit at a time, straight from the definition: independent of both the table
// and the three-stripe hardware path.
uint32_t BitwiseCrc32c(const uint8_t* data, size_t size) {
  uint32_t crc = ~0u;
  for (size_t i = 0; i < size; ++i) {
    crc ^= data[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? 0x82F63B78u : 0);
  }
  return ~crc;
}

// The instruction path works in blocks of three 4 KiB stripes, the
// carry-less one in 256-byte turns, then 64- and 16-byte folds, then words
// and bytes: sizes below, at and around each, at every alignment mod 8, on
// every path this CPU runs.
TEST(Crc32cTest, EveryPathMatchesTheDefinitionAcrossItsBlockBoundaries) {
  std::mt19937 rng(11);
  std::vector<uint8_t> data(3 * 3 * 4096 + 64);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  std::vector<size_t> sizes = {0,   1,   7,    8,    15,    16,    17,    63,    64,
                               255, 256, 257,  271,  272,   319,   320,   511,   512,
                               513, 767, 4095, 4096, 12287, 12288, 12289, 24576, 24583};
  for (int i = 0; i < 40; ++i) sizes.push_back(rng() % (data.size() - 8));
  ASSERT_EQ(SupportedCrc32cPaths().front(), Crc32cPath::kTable);
  for (Crc32cPath path : SupportedCrc32cPaths()) {
    SCOPED_TRACE(static_cast<int>(path));
    for (size_t size : sizes) {
      for (size_t offset = 0; offset < 8; ++offset) {
        const uint8_t* p = data.data() + offset;
        const uint32_t want = BitwiseCrc32c(p, size);
        ASSERT_EQ(Crc32c(p, size, 0, path), want) << "size " << size << " offset " << offset;
        // Continued from a running CRC, which the first block takes in.
        const size_t split = size / 3;
        ASSERT_EQ(Crc32c(p + split, size - split, Crc32c(p, split, 0, path), path), want)
            << "size " << size << " split " << split;
      }
    }
  }
  // The default is one of them.
  const auto& paths = SupportedCrc32cPaths();
  EXPECT_NE(std::find(paths.begin(), paths.end(), FastestCrc32cPath()), paths.end());
}

}  // namespace
}  // namespace layercast
