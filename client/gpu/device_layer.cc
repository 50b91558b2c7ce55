#include "client/gpu/device_layer.h"

#include "client/gpu/cuda_status.h"

namespace layercast::gpu {

DeviceLayer::TensorView DeviceLayer::tensor(size_t i) const {
  const TensorSpec& spec = spec_->tensors[i];
  const AssembledTensor& placed = layout_->tensors()[i];
  const auto* bytes = static_cast<const uint8_t*>(buffer_.data());
  TensorView view{.name = spec.name,
                  .shape = spec.shape,
                  .dtype = placed.compute_dtype,
                  .data = bytes + placed.byte_offset,
                  .num_bytes = placed.num_bytes(),
                  .num_elements = placed.num_elements};
  if (placed.block_size != 0) {
    view.block_size = placed.block_size;
    view.scales = reinterpret_cast<const float*>(bytes + placed.scale_offset);
    view.num_blocks = placed.num_blocks();
  }
  return view;
}

std::optional<DeviceLayer::TensorView> DeviceLayer::Find(absl::string_view name) const {
  for (size_t i = 0; i < spec_->tensors.size(); ++i) {
    if (spec_->tensors[i].name == name) return tensor(i);
  }
  return std::nullopt;
}

absl::Status DeviceLayer::WaitOn(cudaStream_t stream) const {
  return CudaStatus(cudaStreamWaitEvent(stream, ready_.get(), 0),
                    "cudaStreamWaitEvent on a layer's ready event");
}

}  // namespace layercast::gpu
