#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "core/layout.h"

namespace layercast::tools {

// The gradients the training demo, benchmark and end-to-end tests push:
// deterministic, cheap, different for every worker, step, layer, tensor and
// element, and simple enough to recompute in a few lines of Python
// (tests/integration/training_torch_test.py does):
//
//   k = (i*7 + tensor*13 + layer*31 + step*17 + worker*101) mod 1000
//   g = float32(k - 500) * float32(1e-4)     (one float32 multiply)
float SyntheticGradient(uint32_t worker, uint64_t step, uint32_t layer, uint32_t tensor,
                        uint64_t element);

// Fills `buffer` with layer `layer`'s synthetic gradient in `layout` (the
// layer's gradient layout, GradientLayout), each tensor cast to its dtype,
// padding zeroed. REQUIRES: buffer.size() == layout.total_bytes(). An
// 8-bit float tensor (a served layout, not a gradient's) is CastFromF32's
// INVALID_ARGUMENT.
absl::Status FillSyntheticGradient(const AssembledLayout& layout, uint32_t worker, uint64_t step,
                                   uint32_t layer, std::span<uint8_t> buffer);

}  // namespace layercast::tools
