#include "core/cast.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/cast_dispatch.h"
#include "core/cast_error.h"
#include "core/cast_kernels.h"

namespace layercast {
namespace {

using internal::Kernels;
using internal::KernelsFor;

absl::Status OverflowError(const float* src, size_t index) {
  return absl::OutOfRangeError(absl::StrCat("element ", index, " is ", src[index],
                                            ", beyond float16's largest finite value 65504"));
}

// Enough for the bounce buffers of unaligned 16-bit data, small for the stack.
constexpr size_t kBounceElements = 2048;

absl::Status NarrowToF16(const Kernels& kernels, std::span<const float> src,
                         std::span<uint16_t> dst, Fp16Overflow overflow) {
  if (src.size() != dst.size()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot cast ", src.size(),
                                                   " float32 elements into room for ", dst.size(),
                                                   ": the sizes must be equal"));
  }
  const size_t done = kernels.f32_to_f16(src.data(), dst.data(), src.size(), overflow);
  if (done != src.size()) return OverflowError(src.data(), done);
  return absl::OkStatus();
}

const Kernels& Dispatched() { return internal::DispatchedKernels(); }

}  // namespace

void CastF32ToBF16(std::span<const float> src, std::span<uint16_t> dst) {
  assert(src.size() == dst.size());
  Dispatched().f32_to_bf16(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

void CastF32ToBF16(std::span<const float> src, std::span<uint16_t> dst, CastIsa isa) {
  assert(src.size() == dst.size());
  KernelsFor(isa).f32_to_bf16(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

absl::Status CastF32ToF16(std::span<const float> src, std::span<uint16_t> dst,
                          Fp16Overflow overflow) {
  return NarrowToF16(Dispatched(), src, dst, overflow);
}

absl::Status CastF32ToF16(std::span<const float> src, std::span<uint16_t> dst,
                          Fp16Overflow overflow, CastIsa isa) {
  return NarrowToF16(KernelsFor(isa), src, dst, overflow);
}

void CastBF16ToF32(std::span<const uint16_t> src, std::span<float> dst) {
  assert(src.size() == dst.size());
  Dispatched().bf16_to_f32(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

void CastBF16ToF32(std::span<const uint16_t> src, std::span<float> dst, CastIsa isa) {
  assert(src.size() == dst.size());
  KernelsFor(isa).bf16_to_f32(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

void CastF16ToF32(std::span<const uint16_t> src, std::span<float> dst) {
  assert(src.size() == dst.size());
  Dispatched().f16_to_f32(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

void CastF16ToF32(std::span<const uint16_t> src, std::span<float> dst, CastIsa isa) {
  assert(src.size() == dst.size());
  KernelsFor(isa).f16_to_f32(src.data(), dst.data(), std::min(src.size(), dst.size()));
}

absl::Status CastFromF32(const float* src, void* dst, size_t count, DType to,
                         Fp16Overflow overflow) {
  return CastFromF32(src, dst, count, to, overflow, nullptr);
}

absl::Status CastFromF32(const float* src, void* dst, size_t count, DType to, Fp16Overflow overflow,
                         CastError* error) {
  if (IsFloat8(to)) {
    return absl::InvalidArgumentError(
        absl::StrCat("casting to ", DTypeName(to),
                     " needs block scales: quantize with QuantizeFp8 (core/fp8.h)"));
  }
  if (to == DType::kFloat32) {
    if (count != 0) std::memcpy(dst, src, count * sizeof(float));
    if (error != nullptr) error->elements += count;
    return absl::OkStatus();
  }
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % alignof(uint16_t) == 0;
  static const bool fused = internal::CpuRunsIsa(CastIsa::kAvx512);
  if (aligned && error != nullptr && fused) {
    // One pass that measures from the registers it casts in: wherever the CPU
    // has AVX-512, whichever variant the plain cast dispatches to (the bits
    // are the same).
    auto* out = static_cast<uint16_t*>(dst);
    CastError lost;  // added to *error only when the whole cast succeeds
    lost.sample_every = error->sample_every;
    size_t done = count;
    if (to == DType::kBFloat16) {
      internal::F32ToBF16MeasuredAvx512(src, out, count, internal::kBF16Limits, &lost);
    } else {
      done =
          internal::F32ToF16MeasuredAvx512(src, out, count, overflow, internal::kF16Limits, &lost);
    }
    if (done != count) return OverflowError(src, done);
    error->Add(lost);
    return absl::OkStatus();
  }
  const Kernels& kernels = Dispatched();
  // Narrows [0, n) into `out`; returns the first overflowing index or n.
  auto narrow = [&](const float* from, uint16_t* out, size_t n) -> size_t {
    if (to == DType::kBFloat16) {
      kernels.f32_to_bf16(from, out, n);
      return n;
    }
    return kernels.f32_to_f16(from, out, n, overflow);
  };
  if (aligned && error == nullptr) {
    const size_t done = narrow(src, static_cast<uint16_t*>(dst), count);
    return done == count ? absl::OkStatus() : OverflowError(src, done);
  }
  // Pieces: measured while in L1, or bounced, since the kernels store whole
  // uint16_t, which an odd address cannot hold.
  uint16_t bounce[kBounceElements];
  auto* out = static_cast<unsigned char*>(dst);
  CastError lost;  // as above
  if (error != nullptr) lost.sample_every = error->sample_every;
  for (size_t begin = 0; begin < count; begin += kBounceElements) {
    const size_t n = std::min(kBounceElements, count - begin);
    uint16_t* piece = aligned ? static_cast<uint16_t*>(dst) + begin : bounce;
    const size_t done = narrow(src + begin, piece, n);
    if (error != nullptr && done == n) MeasureCastError(src + begin, piece, n, to, &lost);
    if (!aligned) std::memcpy(out + begin * sizeof(uint16_t), bounce, done * sizeof(uint16_t));
    if (done != n) return OverflowError(src, begin + done);
  }
  if (error != nullptr) error->Add(lost);
  return absl::OkStatus();
}

void CastToF32(const void* src, DType from, float* dst, size_t count) {
  assert(!IsFloat8(from));
  if (from == DType::kFloat32) {
    if (count != 0) std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  const Kernels& kernels = Dispatched();
  const auto widen = from == DType::kBFloat16 ? kernels.bf16_to_f32 : kernels.f16_to_f32;
  if (reinterpret_cast<uintptr_t>(src) % alignof(uint16_t) == 0) {
    widen(static_cast<const uint16_t*>(src), dst, count);
    return;
  }
  uint16_t bounce[kBounceElements];
  const auto* in = static_cast<const unsigned char*>(src);
  for (size_t begin = 0; begin < count; begin += kBounceElements) {
    const size_t n = std::min(kBounceElements, count - begin);
    std::memcpy(bounce, in + begin * sizeof(uint16_t), n * sizeof(uint16_t));
    widen(bounce, dst + begin, n);
  }
}

}  // namespace layercast
