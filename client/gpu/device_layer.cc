#include "client/gpu/device_layer.h"

#include "client/gpu/cuda_status.h"

namespace layercast::gpu {

DeviceLayer::TensorView DeviceLayer::tensor(size_t i) const {
  const TensorSpec& spec = spec_->tensors[i];
  const AssembledTensor& placed = layout_->tensors()[i];
  return TensorView{spec.name,
                    spec.shape,
                    placed.compute_dtype,
                    static_cast<const uint8_t*>(buffer_.data()) + placed.byte_offset,
                    placed.num_bytes(),
                    placed.num_elements};
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
