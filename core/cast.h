#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"

namespace layercast {

struct CastError;  // core/cast_error.h

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

// The four casts. Each is dispatched on its own: a variant that is fastest at
// one can be slowest at another (on AMD EPYC Zen 4 and 5 the AVX-512 integer
// kernel narrowed to bf16 at half the AVX2 kernel's speed, while its fp16
// conversion instructions kept pace).
enum class CastKind { kF32ToBF16, kF32ToF16, kBF16ToF32, kF16ToF32 };
inline constexpr CastKind kCastKinds[] = {CastKind::kF32ToBF16, CastKind::kF32ToF16,
                                          CastKind::kBF16ToF32, CastKind::kF16ToF32};
// "f32_to_bf16", "f32_to_f16", "bf16_to_f32", "f16_to_f32".
absl::string_view CastKindName(CastKind kind);

// The variant the functions without a CastIsa argument use for `kind`:
// chosen by this CPU's model (CPUID's vendor and family) from a fixed table
// (core/cast_dispatch.cc; the widest variant the CPU runs where the table
// has no row), so every process on one kind of machine runs the same
// kernels, start after start, unless ChooseCastIsa named one before.
// Passing a variant this CPU lacks to a function runs kScalar (same bits).
CastIsa BestCastIsa(CastKind kind);

// How BestCastIsa's variants were picked.
struct CastIsaSelection {
  struct Choice {
    CastKind kind = CastKind::kF32ToBF16;
    CastIsa isa = CastIsa::kScalar;
  };
  bool chosen = false;               // by ChooseCastIsa, not by the table
  std::vector<Choice> choices = {};  // one per kind, in kCastKinds order
  // The CPU as CPUID names it ("AuthenticAMD family 0x1a model 0x2") and
  // the table's row for it ("AMD Zen 5"); empty when chosen.
  std::string cpu = {};
  std::string row = {};

  CastIsa For(CastKind kind) const { return choices[static_cast<int>(kind)].isa; }
  // The variant's name where every cast uses one ("avx2"), else each cast's
  // ("f32_to_bf16=avx512bf16,f32_to_f16=avx512,bf16_to_f32=avx2,f16_to_f32=avx2").
  std::string Summary() const;
  // For the start-up log: the CPU, its row and each cast's variant ("by
  // CPUID, AuthenticAMD family 0x1a model 0x2 (AMD Zen 5): f32_to_bf16
  // avx512bf16; ..."), or the chosen one.
  std::string Describe() const;
};
// Picks on first use (CPUID only: nothing is timed).
const CastIsaSelection& SelectedCastIsa();

// Makes `isa` BestCastIsa's variant for every cast, for experiments (where
// `isa` has no kernel of its own for a cast, its base variant's runs). FAILED_PRECONDITION
// when this CPU does not run it, or when a variant was picked already (a
// cast without a CastIsa argument ran).
absl::Status ChooseCastIsa(CastIsa isa);
// "scalar", "avx2", "avx512" or "avx512bf16"; INVALID_ARGUMENT naming them
// otherwise.
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
// `dst` holds count * DTypeSize(to) bytes and may be unaligned. An 8-bit
// `to` is INVALID_ARGUMENT: it needs block scales (QuantizeFp8, core/fp8.h).
absl::Status CastFromF32(const float* src, void* dst, size_t count, DType to,
                         Fp16Overflow overflow);
// The same, also adding what the cast lost to `*error` (core/cast_error.h).
// Where the CPU has AVX-512, each element is measured from the registers it
// is cast in (whichever variant the plain cast dispatches to; the bits are
// the same), or only tested for the rare kinds of loss outside the sample
// that error->sample_every asks for; elsewhere each piece of a few KiB is
// measured whole right after it is cast, while it is in L1. Either way the data crosses the memory
// bus once. A copy to kFloat32 loses nothing and only counts its elements. When the cast fails (an
// overflow under Fp16Overflow::kError), `*error` is left as it was.
absl::Status CastFromF32(const float* src, void* dst, size_t count, DType to, Fp16Overflow overflow,
                         CastError* error);

// Widens `count` elements of dtype `from` at `src` (possibly unaligned) to fp32.
// REQUIRES: `from` is not an 8-bit float (DequantizeFp8 needs its scales).
void CastToF32(const void* src, DType from, float* dst, size_t count);

}  // namespace layercast
