// AVX-512 BF16 kernel: f32 -> bf16 with the conversion instruction
// (VCVTNE2PS2BF16), two vectors a turn. Compiled with -mavx512bf16 besides
// the AVX-512 set (core/CMakeLists.txt); called only after cast.cc has seen
// AVX512_BF16 in CPUID.
//
// The instruction rounds to nearest even as the contract does, but it
// treats subnormal inputs as zero (whatever MXCSR says) and keeps a NaN's
// payload where the contract wants the plain quiet NaN. Any 32-element block
// holding a subnormal or a NaN goes to the exact integer kernel instead; the
// test is integer compares, so it does not depend on MXCSR's DAZ either.
// Normal inputs never round to a bf16 subnormal (the exponent ranges are the
// same), so the instruction's flushing of outputs never applies.

#include <cstddef>
#include <cstdint>

#include "core/cast_kernels.h"
#include "core/x86_intrinsics.h"

namespace layercast::internal {
namespace {

// As in cast_avx512.cc: 16 KiB ahead keeps a long cast reading at memory
// speed across page boundaries, where the hardware prefetchers stop.
void PrefetchAhead(const float* p) {
  constexpr uintptr_t kAheadBytes = 16 << 10;
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kAheadBytes),
               _MM_HINT_T0);
}

// Lanes holding a subnormal (magnitude 1 to 0x7FFFFF) or a NaN (above
// 0x7F800000). Zeros and infinities convert exactly.
__mmask16 Special(__m512i u) {
  const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 subnormal = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(abs, _mm512_set1_epi32(1)),
                                                      _mm512_set1_epi32(0x007FFFFF));
  return subnormal | _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7F800000));
}

}  // namespace

void F32ToBF16Avx512Bf16(const float* src, uint16_t* dst, size_t n) {
  // Up to the source's next 64-byte boundary in the integer kernel: loads
  // straddling two cache lines cost AMD Zen 4 and 5 twice an aligned one
  // (cast_avx512.cc). The loads below stay the unaligned kind: as fast once
  // aligned, and a source off its 4-byte alignment must not fault.
  size_t i = ((64 - (reinterpret_cast<uintptr_t>(src) & 63)) & 63) / 4;
  if (i > n) i = n;
  if (i > 0) F32ToBF16Avx512(src, dst, i);
  for (; i + 32 <= n; i += 32) {
    PrefetchAhead(src + i);
    PrefetchAhead(src + i + 16);
    const __m512i lo = _mm512_loadu_si512(src + i);
    const __m512i hi = _mm512_loadu_si512(src + i + 16);
    if ((Special(lo) | Special(hi)) != 0) {
      F32ToBF16Avx512(src + i, dst + i, 32);
      continue;
    }
    // The second operand's elements go to the lower half.
    const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_castsi512_ps(hi), _mm512_castsi512_ps(lo));
    _mm512_storeu_si512(dst + i, reinterpret_cast<const __m512i&>(packed));
  }
  // The tail (under 32 elements) with masked loads, in the integer kernel.
  if (i < n) F32ToBF16Avx512(src + i, dst + i, n - i);
}

}  // namespace layercast::internal
