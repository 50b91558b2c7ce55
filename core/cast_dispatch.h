#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cast.h"

// Which cast kernels run: the variants for each instruction set, what this
// CPU runs, and the selection (by the CPU's model at the first cast, or
// chosen) that the casts without a CastIsa argument use. For core/cast.cc; the public
// side of the selection is in cast.h.

namespace layercast::internal {

struct Kernels {
  void (*f32_to_bf16)(const float*, uint16_t*, size_t);
  size_t (*f32_to_f16)(const float*, uint16_t*, size_t, Fp16Overflow);
  void (*bf16_to_f32)(const uint16_t*, float*, size_t);
  void (*f16_to_f32)(const uint16_t*, float*, size_t);
};

// The kernels of `isa`; an isa this CPU cannot run gets the scalar ones:
// same bits, no SIGILL.
const Kernels& KernelsFor(CastIsa isa);
// Whether this CPU (and its OS) runs `isa`'s kernels.
bool CpuRunsIsa(CastIsa isa);
// The selected kernels, one cast at a time (picked at the first call).
const Kernels& DispatchedKernels();

}  // namespace layercast::internal
