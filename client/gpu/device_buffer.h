#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "client/gpu/cuda_handles.h"

namespace layercast::gpu {

// A block of device memory from a DeviceMemoryPool, freed stream-ordered when
// the handle dies: the free waits for every stream recorded with RecordUse
// (and only for those), so dropping a buffer never blocks the host and never
// pulls memory from under work still queued on the GPU, as long as every
// stream that touches the memory was recorded. This is PyTorch's
// `Tensor.record_stream` contract. The release hook (a budget returns its
// bytes there) runs on the dropping thread and receives an event that
// completes when the memory is really free on the device; an empty event if
// the free could not be enqueued (the context is broken: treat it as free).
//
// Move-only; not thread-safe.
class DeviceBuffer {
 public:
  using ReleaseHook = std::function<void(CudaEvent freed)>;

  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer();

  // Device pointer; nullptr for an empty buffer.
  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  int device() const { return device_; }

  // The free will wait for the work enqueued on `stream` up to now.
  absl::Status RecordUse(cudaStream_t stream);

 private:
  friend class DeviceMemoryPool;
  DeviceBuffer(void* data, uint64_t size, int device, std::shared_ptr<CudaStream> free_stream,
               ReleaseHook on_release)
      : data_(data),
        size_(size),
        device_(device),
        free_stream_(std::move(free_stream)),
        on_release_(std::move(on_release)) {}
  void Reset();

  void* data_ = nullptr;
  uint64_t size_ = 0;
  int device_ = 0;
  std::shared_ptr<CudaStream> free_stream_;  // shared with the pool and its other buffers
  std::vector<CudaEvent> uses_;
  ReleaseHook on_release_;
};

// A stream-ordered device memory pool (cudaMemPoolCreate) on one device that
// keeps up to `keep_bytes` of freed memory mapped (its release threshold), so
// a walk under a budget reuses the same device memory rather than handing it
// back to the driver at every synchronisation and mapping it again. Its
// allocations and frees run on one stream of its own.
//
// Buffers may outlive the pool: CUDA defers destroying a pool until its last
// allocation is freed. Thread-safe.
class DeviceMemoryPool {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceMemoryPool>> Create(int device, uint64_t keep_bytes);
  ~DeviceMemoryPool();
  DeviceMemoryPool(const DeviceMemoryPool&) = delete;
  DeviceMemoryPool& operator=(const DeviceMemoryPool&) = delete;

  // Allocates `bytes` ordered on `stream` (usable by work enqueued on it from
  // now on; other streams must wait for it). The allocation is made on the
  // pool's own stream, after every free of this pool enqueued so far, so that
  // it reuses their memory; `stream` waits for it. Whoever writes or reads
  // the buffer, on `stream` or elsewhere, calls RecordUse after enqueuing
  // that work. RESOURCE_EXHAUSTED when the device is out of memory.
  // `on_release` is attached only to a buffer returned: after an error it
  // never runs.
  absl::StatusOr<DeviceBuffer> Allocate(uint64_t bytes, cudaStream_t stream,
                                        DeviceBuffer::ReleaseHook on_release = {});

  int device() const { return device_; }
  // Device memory the pool holds now / has held at most (cudaMemPoolAttr
  // ReservedMemCurrent / ReservedMemHigh), and the most its allocations held
  // at once (UsedMemHigh), in bytes; 0 if the query fails.
  uint64_t reserved_bytes() const;
  uint64_t reserved_high_bytes() const;
  uint64_t used_high_bytes() const;

 private:
  DeviceMemoryPool(int device, cudaMemPool_t pool, std::shared_ptr<CudaStream> free_stream)
      : device_(device), pool_(pool), free_stream_(std::move(free_stream)) {}

  const int device_;
  const cudaMemPool_t pool_;
  const std::shared_ptr<CudaStream> free_stream_;
};

}  // namespace layercast::gpu
