#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "client/gpu/cuda_handles.h"

namespace layercast::gpu {

// One rank's handle on an NCCL communicator, with every wait bounded: the
// communicator is non-blocking (ncclConfig_t::blocking = 0), and set-up and
// each collective are polled with ncclCommGetAsyncError (and cudaEventQuery)
// until they finish, fail, or pass their deadline; then the communicator is
// aborted (ncclCommAbort) and the caller gets a status, never a hang. After an
// abort every call answers FAILED_PRECONDITION: make a new communicator.
//
// Not thread-safe: one thread drives a rank's communicator.
class NcclComm {
 public:
  // Joins the communicator of `nranks` ranks named by `id` as rank `rank`,
  // on CUDA device `device`. DEADLINE_EXCEEDED naming the rank and the count
  // when the others have not all joined within `timeout`; INVALID_ARGUMENT for
  // a rank out of range; NCCL's own error (with ncclGetLastError's text)
  // otherwise, e.g. INTERNAL "unhandled cuda error" without a GPU.
  static absl::StatusOr<std::unique_ptr<NcclComm>> Create(int rank, int nranks,
                                                          const ncclUniqueId& id, int device,
                                                          std::chrono::milliseconds timeout);
  // Finalizes (bounded by a few seconds) and destroys the communicator, or
  // aborts it if it cannot be finalized cleanly.
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  int device() const { return device_; }

  // One all-gather of bytes: every rank sends `bytes_per_rank` bytes from
  // `send`; rank i's bytes land at recv + i * bytes_per_rank on every rank.
  // In place when send == recv + rank() * bytes_per_rank. Device pointers.
  struct AllGatherPart {
    const void* send;
    void* recv;
    uint64_t bytes_per_rank;
  };

  // Enqueues the parts as one NCCL group on `stream` (after the work already
  // there) and waits on the host until they have completed on the device.
  // Past `timeout` (DEADLINE_EXCEEDED) or on an asynchronous NCCL or CUDA
  // error (its status; UNAVAILABLE when a peer went away) the communicator is
  // aborted first.
  absl::Status AllGather(std::span<const AllGatherPart> parts, cudaStream_t stream,
                         std::chrono::milliseconds timeout);

 private:
  NcclComm(ncclComm_t comm, int rank, int nranks, int device, CudaEvent done)
      : comm_(comm), rank_(rank), nranks_(nranks), device_(device), done_(std::move(done)) {}

  // Polls ncclCommGetAsyncError until the communicator leaves ncclInProgress
  // (an operation has been set up or enqueued); aborts on error or deadline.
  absl::Status WaitWhileInProgress(std::chrono::steady_clock::time_point deadline,
                                   const char* what);
  // Aborts the communicator and returns `status` with this rank named.
  absl::Status Abort(absl::Status status);
  std::string Describe() const;

  ncclComm_t comm_;  // nullptr once aborted or destroyed
  const int rank_;
  const int nranks_;
  const int device_;
  CudaEvent done_;  // recorded after each collective, polled for completion
};

}  // namespace layercast::gpu
