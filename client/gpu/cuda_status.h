#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace layercast::gpu {

// CUDA and NCCL results as absl::Status, so errors cross module boundaries
// the way every other layercast error does. `what` names the call and its
// arguments ("cudaMemcpyAsync of 16 MiB to device 0"); the message adds the
// library's own name and text for the error.

// OK for cudaSuccess. Out of memory is RESOURCE_EXHAUSTED; a missing or too
// old driver and "no device" are FAILED_PRECONDITION; anything else INTERNAL.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// OK for ncclSuccess. Invalid arguments or usage are INVALID_ARGUMENT; system
// and remote errors (a peer died, a socket closed) UNAVAILABLE; anything else
// INTERNAL. `detail` (ncclGetLastError) is appended when non-empty.
absl::Status NcclStatus(ncclResult_t result, absl::string_view what, absl::string_view detail = {});

// The number of CUDA devices, or FAILED_PRECONDITION whose message begins
// "no CUDA device: cudaGetDeviceCount returned ..." when there is none (no
// driver, as on CI machines, counts as none). Tests skip with this message.
absl::StatusOr<int> CudaDeviceCount();

// Makes `device` current for the calling thread for the guard's lifetime
// (the CUDA runtime's current device is per thread). Errors from
// cudaSetDevice are reported by status(). Not thread-safe; stack use only.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

}  // namespace layercast::gpu

// Returns from the enclosing function (which returns absl::Status or
// absl::StatusOr) when a CUDA call fails; `what` as for CudaStatus.
#define CUDA_RETURN_IF_ERROR(call, what)                                  \
  do {                                                                    \
    const cudaError_t _layercast_cuda_error = (call);                     \
    if (_layercast_cuda_error != cudaSuccess) {                           \
      return ::layercast::gpu::CudaStatus(_layercast_cuda_error, (what)); \
    }                                                                     \
  } while (0)
