#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/gpu/cuda_handles.h"
#include "client/gpu/device_buffer.h"
#include "core/dtype.h"
#include "core/layout.h"
#include "core/model.h"

namespace layercast::gpu {

// One gathered layer in device memory: every tensor in its compute dtype at
// its assembled offset, in one device allocation with the host layout, so
// tensor i starts at data() + layout.tensors()[i].byte_offset exactly as in a
// host client::Layer. The copies (and all-gather) that fill it are enqueued,
// not necessarily done: ready_event() completes when they are, so a compute
// stream waits for the layer on the GPU (WaitOn), never on the host.
//
// An RAII handle: dropping it frees the memory stream-ordered and returns its
// bytes to the budget that lent them once the free has happened on the
// device. Before dropping, call RecordUse for every stream that read it other
// than the one that landed it (as PyTorch's `record_stream`).
//
// Move-only; const methods are thread-safe.
class DeviceLayer {
 public:
  struct TensorView {
    absl::string_view name;
    std::span<const int64_t> shape;
    DType dtype;
    const void* data;  // device pointer; num_bytes of little-endian elements
    uint64_t num_bytes;
    uint64_t num_elements;
    // 8-bit floats only (else 0 and null): element i's value is
    // value(code i) * scales[i / block_size] (core/fp8.h), with the
    // num_blocks fp32 scales on the device beside the codes.
    uint32_t block_size = 0;
    const float* scales = nullptr;  // device pointer
    uint64_t num_blocks = 0;
  };

  // `spec` and `layout` describe the buffer's first layout->total_bytes()
  // bytes (the buffer may be larger: padding for an all-gather); `ready` was
  // recorded after the last write. `spec` and `layout` must outlive the layer.
  DeviceLayer(uint32_t index, const LayerSpec* spec, const AssembledLayout* layout,
              uint64_t version, DeviceBuffer buffer, CudaEvent ready)
      : index_(index),
        spec_(spec),
        layout_(layout),
        version_(version),
        buffer_(std::move(buffer)),
        ready_(std::move(ready)) {}

  uint32_t index() const { return index_; }
  const std::string& name() const { return spec_->name; }
  uint64_t version() const { return version_; }
  int device() const { return buffer_.device(); }
  size_t num_tensors() const { return spec_->tensors.size(); }
  TensorView tensor(size_t i) const;
  std::optional<TensorView> Find(absl::string_view name) const;

  // The assembled layer: layout.total_bytes() bytes at a device address.
  const void* data() const { return buffer_.data(); }
  uint64_t size() const { return layout_->total_bytes(); }
  // Device bytes the layer holds (its budget charge), size() or more.
  uint64_t allocated_bytes() const { return buffer_.size(); }

  // Completes when every byte of the layer is on the device.
  cudaEvent_t ready_event() const { return ready_.get(); }
  // Makes `stream` wait for ready_event() (cudaStreamWaitEvent; no host wait).
  absl::Status WaitOn(cudaStream_t stream) const;
  // The memory is freed only after the work enqueued on `stream` up to now.
  absl::Status RecordUse(cudaStream_t stream) { return buffer_.RecordUse(stream); }

 private:
  uint32_t index_;
  const LayerSpec* spec_;
  const AssembledLayout* layout_;
  uint64_t version_;
  DeviceBuffer buffer_;
  CudaEvent ready_;
};

}  // namespace layercast::gpu
