#include "client/gpu/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace layercast::gpu {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status NcclStatus(ncclResult_t result, absl::string_view what, absl::string_view detail) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", ncclGetErrorString(result));
  if (!detail.empty()) absl::StrAppend(&message, " (", detail, ")");
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    case ncclSystemError:
    case ncclRemoteError:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    // Clear the sticky "last error" so later, unrelated calls do not report it.
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device: cudaGetDeviceCount returned ", cudaGetErrorName(error), " (",
                     cudaGetErrorString(error), ")"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        "no CUDA device: cudaGetDeviceCount returned cudaSuccess with 0 devices");
  }
  return count;
}

DeviceGuard::DeviceGuard(int device) {
  status_ = CudaStatus(cudaGetDevice(&previous_), "cudaGetDevice");
  if (status_.ok() && previous_ != device) {
    status_ = CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }
  if (!status_.ok()) previous_ = -1;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace layercast::gpu
