#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace layercast {

// Exact conversions between fp32 masters and the 16-bit compute dtypes.
//
// Narrowing rounds to nearest, ties to even; subnormals are kept (never
// flushed); +-inf stays +-inf; NaN becomes the quiet NaN with the input's sign
// (bf16 0x7FC0, fp16 0x7E00, sign bit or'ed in). For every non-NaN input the
// bits equal PyTorch's `x.to(torch.bfloat16)` / `x.to(torch.float16)`.
// Widening is exact (a float16 signalling NaN comes back quiet, as the
// hardware conversion does; payloads and signs are kept).
//
// Every function writes into memory the caller owns: `dst.size()` must equal
// `src.size()` (CastF32ToF16 returns INVALID_ARGUMENT otherwise; the others
// assert in debug builds and convert the shorter length). All functions are
// thread-safe (no shared state after the one-time CPU feature detection).

// An instruction-set variant of the kernels. Every variant gives identical bits.
enum class CastIsa {
  kScalar,
  kAvx2,    // AVX2 + F16C
  kAvx512,  // AVX-512 F + BW
  // AVX-512 BF16's conversion instruction for f32 -> bf16; the AVX-512
  // kernels for the rest.
  kAvx512Bf16,
};

absl::string_view CastIsaName(CastIsa isa);

// Variants this CPU can run, kScalar first, widest last.
const std::vector<CastIsa>& SupportedCastIsas();

// The variant the functions without a CastIsa argument use: the fastest this
// CPU runs, measured once, at first use, unless ChooseCastIsa named one
// before. The widest is not always the fastest: on AMD EPYC (Zen 4) the
// AVX-512 kernels narrowed at half the AVX2 kernels' speed (bench/cast_bench).
// Passing a variant this CPU lacks to a function runs kScalar (same bits).
CastIsa BestCastIsa();

// How BestCastIsa's variant was picked.
struct CastIsaSelection {
  CastIsa isa = CastIsa::kScalar;
  bool chosen = false;  // by ChooseCastIsa, not measured
  // Each vector variant's speed narrowing fp32 to bf16 from memory, in GB/s
  // of fp32 read: the best of two passes over 64 MiB, more than a last-level
  // cache holds (about 30 ms in all, once, and 96 MiB for that time).
  std::vector<std::pair<CastIsa, double>> measured;
};
const CastIsaSelection& SelectedCastIsa();

// Makes `isa` BestCastIsa's variant, for experiments. FAILED_PRECONDITION
// when this CPU does not run it, or when a variant was picked already (a
// cast without a CastIsa argument ran).
absl::Status ChooseCastIsa(CastIsa isa);
// "scalar", "avx2" or "avx512"; INVALID_ARGUMENT naming them otherwise.
absl::StatusOr<CastIsa> CastIsaFromName(absl::string_view name);

// What narrowing to fp16 does with a finite fp32 whose rounded value lies
// beyond fp16's largest finite value (65504).
enum class Fp16Overflow {
  kError,     // return OUT_OF_RANGE naming the first offending index and value
  kSaturate,  // clamp to +-65504
  kInfinity,  // +-inf, as PyTorch and IEEE 754 do
};

void CastF32ToBF16(std::span<const float> src, std::span<uint16_t> dst);
void CastF32ToBF16(std::span<const float> src, std::span<uint16_t> dst, CastIsa isa);

// With kError, an OUT_OF_RANGE status reports the first overflowing element
// ("element 17 is 70000, beyond float16's largest finite value 65504"); `dst`
// is then left partially written.
absl::Status CastF32ToF16(std::span<const float> src, std::span<uint16_t> dst,
                          Fp16Overflow overflow);
absl::Status CastF32ToF16(std::span<const float> src, std::span<uint16_t> dst,
                          Fp16Overflow overflow, CastIsa isa);

void CastBF16ToF32(std::span<const uint16_t> src, std::span<float> dst);
void CastBF16ToF32(std::span<const uint16_t> src, std::span<float> dst, CastIsa isa);
void CastF16ToF32(std::span<const uint16_t> src, std::span<float> dst);
void CastF16ToF32(std::span<const uint16_t> src, std::span<float> dst, CastIsa isa);

// Narrows `count` fp32 elements at `src` into `dst` in `to` (kFloat32 copies).
// `dst` holds count * DTypeSize(to) bytes and may be unaligned.
absl::Status CastFromF32(const float* src, void* dst, size_t count, DType to,
                         Fp16Overflow overflow);

// Widens `count` elements of dtype `from` at `src` (possibly unaligned) to fp32.
void CastToF32(const void* src, DType from, float* dst, size_t count);

}  // namespace layercast
