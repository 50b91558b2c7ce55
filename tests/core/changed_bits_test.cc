// MarkChangedBits against a plain byte compare, for every element size a
// delta compares (8-bit codes, 16-bit values, 32-bit values and scales),
// lengths around the word and lane boundaries, and a difference in any
// byte of an element.

#include "core/changed_bits.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace layercast {
namespace {

TEST(ChangedBitsTest, MarksExactlyTheElementsWhoseBytesDiffer) {
  std::mt19937 random(3);
  for (const size_t size : {1, 2, 4}) {
    for (const uint64_t n : {0, 1, 7, 8, 63, 64, 65, 127, 1000}) {
      std::vector<uint8_t> was(n * size);
      for (uint8_t& byte : was) byte = static_cast<uint8_t>(random());
      std::vector<uint8_t> now = was;
      for (uint64_t i = 0; i < n; ++i) {
        // About a third changed, in any one of the element's bytes.
        if (random() % 3 == 0)
          now[i * size + random() % size] ^= static_cast<uint8_t>(1 + random() % 255);
      }
      std::vector<uint64_t> bits = {~uint64_t{0}};  // resized and cleared first
      MarkChangedBits(now.data(), was.data(), n, size, bits);
      ASSERT_EQ(bits.size(), (n + 63) / 64) << size << " bytes, " << n << " elements";
      for (uint64_t i = 0; i < n; ++i) {
        const bool differs = std::memcmp(&now[i * size], &was[i * size], size) != 0;
        EXPECT_EQ((bits[i / 64] >> (i % 64) & 1) != 0, differs)
            << "element " << i << " of " << n << ", " << size << " bytes";
      }
      if (n % 64 != 0) {
        EXPECT_EQ(bits.back() >> (n % 64), 0u) << "bits past the elements stay clear";
      }
    }
  }
}

// A shard's change log marks a slice block by block into one bitmap: from
// any bit, keeping the bits already set, and counting what differs.
TEST(ChangedBitsTest, MarksFromAnyBitKeepingWhatWasSetAndCounts) {
  std::mt19937 random(5);
  for (const size_t size : {1, 2, 4}) {
    for (const uint64_t first : {0, 1, 63, 64, 100}) {
      const uint64_t n = 200;
      std::vector<uint8_t> was(n * size);
      for (uint8_t& byte : was) byte = static_cast<uint8_t>(random());
      std::vector<uint8_t> now = was;
      uint64_t differ = 0;
      for (uint64_t i = 0; i < n; ++i) {
        if (random() % 4 == 0) {
          now[i * size + random() % size] ^= 0x10;
          ++differ;
        }
      }
      std::vector<uint64_t> bits((first + n + 63) / 64 + 1, 0);
      bits[0] |= 1;  // set before: kept
      const std::vector<uint64_t> before = bits;
      EXPECT_EQ(MarkChangedBitsFrom(now.data(), was.data(), n, size, first, bits), differ);
      for (uint64_t i = 0; i < bits.size() * 64; ++i) {
        const bool set = bits[i / 64] >> (i % 64) & 1;
        const bool in_span = i >= first && i < first + n;
        const bool differs =
            in_span && std::memcmp(&now[(i - first) * size], &was[(i - first) * size], size) != 0;
        EXPECT_EQ(set, differs || (before[i / 64] >> (i % 64) & 1))
            << "bit " << i << ", first " << first << ", " << size << " bytes";
      }
    }
  }
}

}  // namespace
}  // namespace layercast
