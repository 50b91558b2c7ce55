#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"

namespace layercast::gpu {

// Owning handles for a CUDA stream and a CUDA event: created with a static
// Create (which can fail), destroyed with the handle. Destroying a stream or
// an event with work still pending is allowed: CUDA releases it once that work
// completes. Move-only; not thread-safe (CUDA itself lets several threads
// enqueue on one stream).

class CudaStream {
 public:
  // A non-blocking stream (no implicit sync with the legacy default stream)
  // on the current device.
  static absl::StatusOr<CudaStream> Create();

  CudaStream() = default;
  CudaStream(CudaStream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& other) noexcept;
  ~CudaStream();

  cudaStream_t get() const { return stream_; }

 private:
  explicit CudaStream(cudaStream_t stream) : stream_(stream) {}
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  // An event on the current device; `timing` enables cudaEventElapsedTime
  // (off, an event is cheaper to record and to wait on).
  static absl::StatusOr<CudaEvent> Create(bool timing = false);

  CudaEvent() = default;
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  ~CudaEvent();

  cudaEvent_t get() const { return event_; }
  explicit operator bool() const { return event_ != nullptr; }

 private:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  cudaEvent_t event_ = nullptr;
};

// Page-locked host memory from cudaHostAlloc (portable: usable with every
// device), so cudaMemcpyAsync from it is a real asynchronous DMA. Move-only;
// not thread-safe.
class PinnedBuffer {
 public:
  // RESOURCE_EXHAUSTED when the host cannot lock that much memory.
  static absl::StatusOr<PinnedBuffer> Allocate(uint64_t bytes);

  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  ~PinnedBuffer();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace layercast::gpu
