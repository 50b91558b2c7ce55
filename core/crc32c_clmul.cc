// CRC-32C by carry-less multiplication (VPCLMULQDQ on AVX-512 registers), 256
// bytes a turn. Compiled with -mavx512f -mavx512bw -mvpclmulqdq -mpclmul
// -msse4.2 (core/CMakeLists.txt); called only after crc32c.cc has seen those
// features.
//
// Folding: without the pre- and post-inversion a CRC is the message's
// polynomial times x^32 modulo P, so a 16-byte block B followed by n bytes
// contributes B * x^(8n) mod P, which two carry-less products of B's halves
// by constants give as a 128-bit value to add (xor) to the block n bytes on.
// Folding a buffer down to its last 16 bytes keeps its CRC; the crc32
// instruction finishes those. The constants are reflect32(x^k mod P) << 1
// for k = 8n + 32 (first 8 bytes) and 8n - 32 (last 8), as in Intel's
// "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ" (2009). The
// three-stripe crc32 loop in crc32c.cc runs at one 8-byte word a cycle; this
// does 64 bytes a few cycles (bench/cast_bench, rows crc32c_*).

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/crc32c_kernels.h"
#include "core/x86_intrinsics.h"

namespace layercast::internal {
namespace {

constexpr uint32_t kCastagnoli = 0x1EDC6F41;  // x^32 + ... in normal bit order, x^32 implied

// reflect32(x^k mod P) << 1.
constexpr uint64_t FoldConstant(int k) {
  uint64_t remainder = 1;
  for (int i = 0; i < k; ++i) {
    remainder <<= 1;
    if ((remainder >> 32) != 0) remainder ^= (uint64_t{1} << 32) | kCastagnoli;
  }
  uint64_t reflected = 0;
  for (int bit = 0; bit < 32; ++bit) {
    if (((remainder >> bit) & 1) != 0) reflected |= uint64_t{1} << (31 - bit);
  }
  return reflected << 1;
}

// Constants that carry a 16-byte block kBytes further on.
template <int kBytes>
__m128i FoldBy() {
  constexpr uint64_t kFirstHalf = FoldConstant(8 * kBytes + 32);
  constexpr uint64_t kSecondHalf = FoldConstant(8 * kBytes - 32);
  return _mm_set_epi64x(static_cast<int64_t>(kSecondHalf), static_cast<int64_t>(kFirstHalf));
}

__m512i Fold(__m512i blocks, __m512i constants) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(blocks, constants, 0x00),
                          _mm512_clmulepi64_epi128(blocks, constants, 0x11));
}

__m128i Fold(__m128i block, __m128i constants) {
  return _mm_xor_si128(_mm_clmulepi64_si128(block, constants, 0x00),
                       _mm_clmulepi64_si128(block, constants, 0x11));
}

__m512i Load(const uint8_t* p) { return _mm512_loadu_si512(p); }

}  // namespace

uint32_t Crc32cClmul(const uint8_t* p, size_t size, uint32_t crc) {
  if (size < 256) return Crc32cInstruction(p, size, crc);
  // The running CRC adds to the message's first four bytes.
  __m512i a0 = _mm512_xor_si512(Load(p), _mm512_maskz_set1_epi32(1, static_cast<int>(crc)));
  __m512i a1 = Load(p + 64);
  __m512i a2 = Load(p + 128);
  __m512i a3 = Load(p + 192);
  p += 256;
  size -= 256;
  const __m512i by256 = _mm512_broadcast_i32x4(FoldBy<256>());
  for (; size >= 256; p += 256, size -= 256) {
    a0 = _mm512_xor_si512(Fold(a0, by256), Load(p));
    a1 = _mm512_xor_si512(Fold(a1, by256), Load(p + 64));
    a2 = _mm512_xor_si512(Fold(a2, by256), Load(p + 128));
    a3 = _mm512_xor_si512(Fold(a3, by256), Load(p + 192));
  }
  const __m512i by64 = _mm512_broadcast_i32x4(FoldBy<64>());
  __m512i x = _mm512_ternarylogic_epi64(Fold(a0, _mm512_broadcast_i32x4(FoldBy<192>())),
                                        Fold(a1, _mm512_broadcast_i32x4(FoldBy<128>())),
                                        Fold(a2, by64), 0x96);  // a ^ b ^ c
  x = _mm512_xor_si512(x, a3);
  for (; size >= 64; p += 64, size -= 64) x = _mm512_xor_si512(Fold(x, by64), Load(p));
  // Lane i of x lies (3 - i) * 16 bytes before the last of them.
  __m128i y = _mm_xor_si128(Fold(_mm512_extracti32x4_epi32(x, 0), FoldBy<48>()),
                            Fold(_mm512_extracti32x4_epi32(x, 1), FoldBy<32>()));
  y = _mm_xor_si128(y, Fold(_mm512_extracti32x4_epi32(x, 2), FoldBy<16>()));
  y = _mm_xor_si128(y, _mm512_extracti32x4_epi32(x, 3));
  const __m128i by16 = FoldBy<16>();
  for (; size >= 16; p += 16, size -= 16) {
    y = _mm_xor_si128(Fold(y, by16), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  uint64_t folded = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(y)));
  folded = _mm_crc32_u64(folded, static_cast<uint64_t>(_mm_extract_epi64(y, 1)));
  return Crc32cInstruction(p, size, static_cast<uint32_t>(folded));
}

}  // namespace layercast::internal
