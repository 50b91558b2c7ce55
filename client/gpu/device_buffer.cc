#include "client/gpu/device_buffer.h"

#include "absl/strings/str_cat.h"
#include "client/gpu/cuda_status.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::gpu {

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
    free_stream_ = std::move(other.free_stream_);
    uses_ = std::move(other.uses_);
    on_release_ = std::exchange(other.on_release_, {});
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Reset(); }

absl::Status DeviceBuffer::RecordUse(cudaStream_t stream) {
  DeviceGuard guard(device_);
  if (!guard.status().ok()) return guard.status();
  absl::StatusOr<CudaEvent> event = CudaEvent::Create();
  if (!event.ok()) return event.status();
  CUDA_RETURN_IF_ERROR(cudaEventRecord(event->get(), stream), "cudaEventRecord (buffer use)");
  uses_.push_back(*std::move(event));
  return absl::OkStatus();
}

void DeviceBuffer::Reset() {
  if (data_ == nullptr) return;
  CudaEvent freed;
  {
    DeviceGuard guard(device_);
    cudaStream_t free_stream = free_stream_->get();
    bool ok = guard.status().ok();
    for (const CudaEvent& use : uses_) {
      ok = ok && cudaStreamWaitEvent(free_stream, use.get(), 0) == cudaSuccess;
    }
    if (ok) {
      // Only once every recorded use is waited for: freeing earlier would let
      // the pool hand the memory to a new allocation under a running kernel.
      ok = cudaFreeAsync(data_, free_stream) == cudaSuccess;
      absl::StatusOr<CudaEvent> event = CudaEvent::Create();
      if (ok && event.ok() && cudaEventRecord(event->get(), free_stream) == cudaSuccess) {
        freed = *std::move(event);
      }
    }
    // A broken context cannot free anything; its memory dies with it.
    cudaGetLastError();
  }
  data_ = nullptr;
  size_ = 0;
  uses_.clear();
  free_stream_.reset();
  if (on_release_) std::exchange(on_release_, {})(std::move(freed));
}

absl::StatusOr<std::unique_ptr<DeviceMemoryPool>> DeviceMemoryPool::Create(int device,
                                                                           uint64_t keep_bytes) {
  DeviceGuard guard(device);
  if (!guard.status().ok()) return guard.status();
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool, &props),
                       absl::StrCat("cudaMemPoolCreate on device ", device));
  uint64_t threshold = keep_bytes;
  int reuse_completed_frees = 1;  // on by default; the budget relies on it
  cudaError_t error = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  if (error == cudaSuccess) {
    error =
        cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowOpportunistic, &reuse_completed_frees);
  }
  if (error != cudaSuccess) {
    cudaMemPoolDestroy(pool);
    return CudaStatus(error, "cudaMemPoolSetAttribute");
  }
  absl::StatusOr<CudaStream> stream = CudaStream::Create();
  if (!stream.ok()) {
    cudaMemPoolDestroy(pool);
    return stream.status();
  }
  return std::unique_ptr<DeviceMemoryPool>(
      new DeviceMemoryPool(device, pool, std::make_shared<CudaStream>(*std::move(stream))));
}

DeviceMemoryPool::~DeviceMemoryPool() { cudaMemPoolDestroy(pool_); }

absl::StatusOr<DeviceBuffer> DeviceMemoryPool::Allocate(uint64_t bytes, cudaStream_t stream,
                                                        DeviceBuffer::ReleaseHook on_release) {
  DeviceGuard guard(device_);
  if (!guard.status().ok()) return guard.status();
  // Allocated on the stream the frees run on, after every free enqueued so
  // far: the pool always reuses memory freed earlier on the same stream.
  // Allocated on `stream`, it reused a free from the other stream only once
  // the driver had noticed it complete, which it did not while the host ran
  // ahead of the GPU (docs/gpu.md, "The device budget"). The cost: `stream`
  // also waits for those frees, and each free for the compute that last read
  // its buffer, including frees the budget did not need yet.
  ASSIGN_OR_RETURN(CudaEvent allocated, CudaEvent::Create());
  void* data = nullptr;
  CUDA_RETURN_IF_ERROR(
      cudaMallocFromPoolAsync(&data, bytes == 0 ? 1 : bytes, pool_, free_stream_->get()),
      absl::StrCat("cudaMallocFromPoolAsync of ", FormatBytes(bytes), " on device ", device_));
  DeviceBuffer buffer(data, bytes, device_, free_stream_, {});
  CUDA_RETURN_IF_ERROR(cudaEventRecord(allocated.get(), free_stream_->get()),
                       "cudaEventRecord (allocation)");
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, allocated.get(), 0),
                       "cudaStreamWaitEvent (allocation)");
  // The buffer's free comes after the allocation on the same stream.
  // Only now: a buffer that fails above is freed without its hook, so a caller
  // who sees the error gives its budget back once, not twice.
  buffer.on_release_ = std::move(on_release);
  return buffer;
}

namespace {

uint64_t PoolAttribute(cudaMemPool_t pool, cudaMemPoolAttr attribute) {
  uint64_t value = 0;
  if (cudaMemPoolGetAttribute(pool, attribute, &value) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return value;
}

}  // namespace

uint64_t DeviceMemoryPool::reserved_bytes() const {
  return PoolAttribute(pool_, cudaMemPoolAttrReservedMemCurrent);
}

uint64_t DeviceMemoryPool::reserved_high_bytes() const {
  return PoolAttribute(pool_, cudaMemPoolAttrReservedMemHigh);
}

uint64_t DeviceMemoryPool::used_high_bytes() const {
  return PoolAttribute(pool_, cudaMemPoolAttrUsedMemHigh);
}

}  // namespace layercast::gpu
