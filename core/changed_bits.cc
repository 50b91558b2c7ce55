#include "core/changed_bits.h"

#include <cassert>
#include <cstring>

namespace layercast {
namespace {

// Word by word (SWAR): eight 8-bit, four 16-bit or two 32-bit lanes per 64
// bits, so a 100 MB layer compares in milliseconds; a word of equal lanes
// (most of them, in a delta) costs one XOR.
template <size_t Size>
void Compare(const uint8_t* now, const uint8_t* was, uint64_t n, std::vector<uint64_t>& bits) {
  static_assert(Size == 1 || Size == 2 || Size == 4);
  constexpr uint64_t kLanes = 8 / Size;
  // Per lane: all bits but the top one, and the top one.
  constexpr uint64_t kLow = Size == 1   ? 0x7F7F7F7F7F7F7F7Full
                            : Size == 2 ? 0x7FFF7FFF7FFF7FFFull
                                        : 0x7FFFFFFF7FFFFFFFull;
  constexpr uint64_t kHigh = ~kLow;
  const uint64_t whole = n / kLanes * kLanes;
  for (uint64_t i = 0; i < whole; i += kLanes) {
    uint64_t a, b;
    std::memcpy(&a, now + i * Size, 8);
    std::memcpy(&b, was + i * Size, 8);
    const uint64_t x = a ^ b;
    if (x == 0) continue;
    // The top bit of each lane that is not zero.
    const uint64_t lanes = (((x & kLow) + kLow) | x) & kHigh;
    for (uint64_t lane = 0; lane < kLanes; ++lane) {
      if (lanes >> (lane * Size * 8 + Size * 8 - 1) & 1) {
        bits[(i + lane) / 64] |= uint64_t{1} << ((i + lane) % 64);
      }
    }
  }
  for (uint64_t i = whole; i < n; ++i) {
    if (std::memcmp(now + i * Size, was + i * Size, Size) != 0) {
      bits[i / 64] |= uint64_t{1} << (i % 64);
    }
  }
}

}  // namespace

void MarkChangedBits(const uint8_t* now, const uint8_t* was, uint64_t n, size_t size,
                     std::vector<uint64_t>& bits) {
  bits.assign((n + 63) / 64, 0);
  switch (size) {
    case 1:
      Compare<1>(now, was, n, bits);
      break;
    case 2:
      Compare<2>(now, was, n, bits);
      break;
    default:
      assert(size == 4);
      Compare<4>(now, was, n, bits);
      break;
  }
}

}  // namespace layercast
