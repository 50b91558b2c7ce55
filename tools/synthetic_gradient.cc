#include "tools/synthetic_gradient.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cast.h"
#include "platform/status_macros.h"

namespace layercast::tools {

float SyntheticGradient(uint32_t worker, uint64_t step, uint32_t layer, uint32_t tensor,
                        uint64_t element) {
  const uint64_t k = (element * 7 + uint64_t{tensor} * 13 + uint64_t{layer} * 31 + step * 17 +
                      uint64_t{worker} * 101) %
                     1000;
  return static_cast<float>(static_cast<int64_t>(k) - 500) * 1e-4f;
}

absl::Status FillSyntheticGradient(const AssembledLayout& layout, uint32_t worker, uint64_t step,
                                   uint32_t layer, std::span<uint8_t> buffer) {
  std::memset(buffer.data(), 0, buffer.size());
  constexpr uint64_t kBlock = 1 << 14;
  std::vector<float> values(kBlock);
  for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
    const AssembledTensor& tensor = layout.tensors()[t];
    const size_t size = DTypeSize(tensor.compute_dtype);
    for (uint64_t begin = 0; begin < tensor.num_elements; begin += kBlock) {
      const uint64_t count = std::min(kBlock, tensor.num_elements - begin);
      for (uint64_t i = 0; i < count; ++i) {
        values[i] = SyntheticGradient(worker, step, layer, t, begin + i);
      }
      RETURN_IF_ERROR(CastFromF32(values.data(), buffer.data() + tensor.byte_offset + begin * size,
                                  count, tensor.compute_dtype, Fp16Overflow::kSaturate));
    }
  }
  return absl::OkStatus();
}

}  // namespace layercast::tools
