#include "client/gpu/cuda_handles.h"

#include "absl/strings/str_cat.h"
#include "client/gpu/cuda_status.h"
#include "platform/byte_size.h"

namespace layercast::gpu {

absl::StatusOr<CudaStream> CudaStream::Create() {
  cudaStream_t stream = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags");
  return CudaStream(stream);
}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<CudaEvent> CudaEvent::Create(bool timing) {
  cudaEvent_t event = nullptr;
  CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming),
      "cudaEventCreateWithFlags");
  return CudaEvent(event);
}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

absl::StatusOr<PinnedBuffer> PinnedBuffer::Allocate(uint64_t bytes) {
  PinnedBuffer buffer;
  void* data = nullptr;
  CUDA_RETURN_IF_ERROR(cudaHostAlloc(&data, bytes == 0 ? 1 : bytes, cudaHostAllocPortable),
                       absl::StrCat("cudaHostAlloc of ", FormatBytes(bytes), " pinned staging"));
  buffer.data_ = static_cast<uint8_t*>(data);
  buffer.size_ = bytes;
  return buffer;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

}  // namespace layercast::gpu
