#include "core/crc32c.h"

#include <gtest/gtest.h>

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

TEST(Crc32cTest, MatchesTheDefinitionAcrossStripeBoundaries) {
  // The hardware path works in blocks of three 4 KiB stripes; cover sizes
  // below, at and around one and several blocks, at every alignment mod 8.
  std::mt19937 rng(11);
  std::vector<uint8_t> data(3 * 3 * 4096 + 64);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  std::vector<size_t> sizes = {0, 1, 7, 8, 4095, 4096, 12287, 12288, 12289, 24576, 24583};
  for (int i = 0; i < 40; ++i) sizes.push_back(rng() % (data.size() - 8));
  for (size_t size : sizes) {
    for (size_t offset = 0; offset < 8; ++offset) {
      ASSERT_EQ(Crc32c(data.data() + offset, size), BitwiseCrc32c(data.data() + offset, size))
          << "size " << size << " offset " << offset;
    }
  }
}

}  // namespace
}  // namespace layercast
