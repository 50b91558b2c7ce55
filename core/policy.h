#pragma once

#include <optional>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "core/cast.h"
#include "core/dtype.h"

namespace layercast {

// Elements per fp8 block scale: the policy's default and bounds. At most 256
// so that a block never straddles a kAssembledAlignment boundary of the
// codes: byte ranges on those boundaries (how workers split a layer) never
// split a block.
inline constexpr uint32_t kDefaultFp8Block = 128;
inline constexpr uint32_t kMinFp8Block = 16;
inline constexpr uint32_t kMaxFp8Block = 256;
bool IsValidFp8Block(uint64_t block);

// A mixed-precision policy in jmp's grammar, plus per-tensor overrides.
//
//   policy    := base [';' override (';' override)*]
//   base      := dtype | key '=' dtype (',' key '=' dtype)*
//   key       := 'params' | 'p' | 'compute' | 'c' | 'output' | 'o' | 'overflow'
//              | 'max_rel_error' | 'fp8_block'
//   dtype     := 'float32' | 'f32' | 'full' | 'bfloat16' | 'bf16' | 'float16' | 'f16'
//              | 'float8_e4m3fn' | 'f8e4m3' | 'float8_e5m2' | 'f8e5m2'
//   override  := glob '=' dtype          (compute dtype of matching tensors)
//
// As in jmp: a bare dtype sets all three; otherwise params defaults to
// float32, compute to params and output to compute; a repeated key takes its
// last value. `overflow` (error | saturate | inf, default error) is
// layercast's extension: what narrowing to float16 does with finite values
// beyond 65504. `max_rel_error` (a number in (0, 1], unset by default) is
// another: a shard refuses to serve a layer whose cast has an element with a
// larger relative error |cast - x| / |x| (core/cast_error.h), or one that
// overflowed. The 8-bit floats are compute dtypes only (for compute and
// overrides; params and output refuse them), sent with one fp32 scale per
// block of `fp8_block` elements (a power of two from 16 to 256, default
// 128; core/fp8.h); an 8-bit compute leaves output defaulting to params.
// Overrides match whole tensor names with fnmatch(3) globs
// (platform/glob.h: `*` also matches dots) and the first match wins.
//
// Immutable value type; thread-safe for concurrent reads.
class Policy {
 public:
  struct Override {
    std::string glob;
    DType compute;
    friend bool operator==(const Override&, const Override&) = default;
  };

  // Parses `text`. INVALID_ARGUMENT with a message that quotes the bad part
  // and lists what is accepted.
  static absl::StatusOr<Policy> Parse(absl::string_view text);

  // params=float32,compute=float32,output=float32 with no overrides.
  Policy() = default;

  DType params() const { return params_; }
  DType compute() const { return compute_; }
  DType output() const { return output_; }
  Fp16Overflow overflow() const { return overflow_; }
  std::optional<float> max_rel_error() const { return max_rel_error_; }
  uint32_t fp8_block() const { return fp8_block_; }
  const std::vector<Override>& overrides() const { return overrides_; }
  // Whether the compute dtype or any override's is an 8-bit float.
  bool UsesFloat8() const;

  // The compute dtype of the tensor named `tensor_name`: the first matching
  // override's, else compute().
  DType ComputeDTypeFor(absl::string_view tensor_name) const;

  // Canonical form, which Parse() maps back to an equal Policy:
  // "params=float32,compute=bfloat16,output=float32[,overflow=saturate]
  // [,max_rel_error=0.01][,fp8_block=128][;glob=dtype...]", fp8_block
  // written when an 8-bit float is used or it is not the default.
  std::string ToString() const;

  friend bool operator==(const Policy&, const Policy&) = default;

 private:
  DType params_ = DType::kFloat32;
  DType compute_ = DType::kFloat32;
  DType output_ = DType::kFloat32;
  Fp16Overflow overflow_ = Fp16Overflow::kError;
  std::optional<float> max_rel_error_;
  uint32_t fp8_block_ = kDefaultFp8Block;
  std::vector<Override> overrides_;
};

}  // namespace layercast
