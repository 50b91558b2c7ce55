#include "core/changed_bits.h"

#include <bit>
#include <cassert>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace layercast {
namespace {

// Bit i of the result: elements i of `a` and `b` (64 of `Size` bytes each)
// differ. SSE2 (every x86-64) compares 16 bytes at a time; a compiler does
// not vectorise the scalar loop's shift-or reduction.
template <size_t Size>
uint64_t DifferenceMask64(const uint8_t* a, const uint8_t* b) {
  static_assert(Size == 1 || Size == 2 || Size == 4);
#if defined(__SSE2__)
  uint64_t equal = 0;
  for (size_t group = 0; group < 4; ++group) {  // 16 elements each
    // 16 elements of `Size` bytes fill that many 16-byte vectors.
    __m128i lanes[Size];
    for (size_t v = 0; v < Size; ++v) {
      const size_t at = (group * Size + v) * 16;
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + at));
      const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + at));
      if constexpr (Size == 1) {
        lanes[v] = _mm_cmpeq_epi8(x, y);
      } else if constexpr (Size == 2) {
        lanes[v] = _mm_cmpeq_epi16(x, y);
      } else {
        lanes[v] = _mm_cmpeq_epi32(x, y);
      }
    }
    // Narrowed to one byte per element (all ones or zero survive the
    // signed saturation), then one bit per element.
    __m128i bytes;
    if constexpr (Size == 1) {
      bytes = lanes[0];
    } else if constexpr (Size == 2) {
      bytes = _mm_packs_epi16(lanes[0], lanes[1]);
    } else {
      bytes =
          _mm_packs_epi16(_mm_packs_epi32(lanes[0], lanes[1]), _mm_packs_epi32(lanes[2], lanes[3]));
    }
    equal |= static_cast<uint64_t>(static_cast<uint16_t>(_mm_movemask_epi8(bytes))) << (16 * group);
  }
  return ~equal;
#else
  uint64_t mask = 0;
  for (size_t i = 0; i < 64; ++i) {
    if (std::memcmp(a + i * Size, b + i * Size, Size) != 0) mask |= uint64_t{1} << i;
  }
  return mask;
#endif
}

// ORs `mask` (64 elements' bits) into `bits` from bit `first`.
void MarkMask(uint64_t mask, uint64_t first, std::vector<uint64_t>& bits) {
  const uint64_t shift = first % 64;
  bits[first / 64] |= mask << shift;
  // Only bits that exist can be shifted into the next word.
  if (shift != 0 && (mask >> (64 - shift)) != 0) bits[first / 64 + 1] |= mask >> (64 - shift);
}

template <size_t Size>
uint64_t Mark(const uint8_t* now, const uint8_t* was, uint64_t n, uint64_t first,
              std::vector<uint64_t>& bits) {
  constexpr size_t size = Size;
  uint64_t changed = 0;
  uint64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const uint64_t mask = DifferenceMask64<Size>(now + i * size, was + i * size);
    if (mask == 0) continue;  // most words, in a delta
    changed += static_cast<uint64_t>(std::popcount(mask));
    MarkMask(mask, first + i, bits);
  }
  uint64_t tail = 0;
  for (uint64_t j = 0; i + j < n; ++j) {
    const uint64_t at = (i + j) * size;
    if (std::memcmp(now + at, was + at, size) != 0) tail |= uint64_t{1} << j;
  }
  if (tail != 0) {
    changed += static_cast<uint64_t>(std::popcount(tail));
    MarkMask(tail, first + i, bits);
  }
  return changed;
}

}  // namespace

uint64_t MarkChangedBitsFrom(const uint8_t* now, const uint8_t* was, uint64_t n, size_t size,
                             uint64_t first, std::vector<uint64_t>& bits) {
  assert(bits.size() * 64 >= first + n);
  switch (size) {
    case 1:
      return Mark<1>(now, was, n, first, bits);
    case 2:
      return Mark<2>(now, was, n, first, bits);
    default:
      assert(size == 4);
      return Mark<4>(now, was, n, first, bits);
  }
}

void MarkChangedBits(const uint8_t* now, const uint8_t* was, uint64_t n, size_t size,
                     std::vector<uint64_t>& bits) {
  bits.assign((n + 63) / 64, 0);
  MarkChangedBitsFrom(now, was, n, size, 0, bits);
}

}  // namespace layercast
