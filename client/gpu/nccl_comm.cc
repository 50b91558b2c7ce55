#include "client/gpu/nccl_comm.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "client/gpu/cuda_status.h"
#include "platform/status_macros.h"

namespace layercast::gpu {
namespace {

// How often a wait polls NCCL and CUDA: short against a collective of a few
// MiB (~100 us on NVLink), long enough not to hog a core.
constexpr auto kPollInterval = std::chrono::microseconds(20);

// ncclGetLastError's text for `comm`, or empty.
std::string LastError(ncclComm_t comm) {
  const char* text = ncclGetLastError(comm);
  return text == nullptr ? std::string() : std::string(text);
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclComm>> NcclComm::Create(int rank, int nranks,
                                                           const ncclUniqueId& id, int device,
                                                           std::chrono::milliseconds timeout) {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL rank ", rank, " of ", nranks,
                                                   " is out of range: ranks are 0-", nranks - 1,
                                                   " and there must be at least one"));
  }
  const std::string who = absl::StrCat("NCCL rank ", rank, " of ", nranks, " on device ", device);
  DeviceGuard guard(device);
  RETURN_IF_ERROR(guard.status());
  ASSIGN_OR_RETURN(CudaEvent done, CudaEvent::Create());

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every wait below is ours, with a deadline
  ncclComm_t comm = nullptr;
  const ncclResult_t started = ncclCommInitRankConfig(&comm, nranks, id, rank, &config);
  if (started != ncclSuccess && started != ncclInProgress) {
    const std::string detail = comm != nullptr ? LastError(comm) : LastError(nullptr);
    if (comm != nullptr) ncclCommAbort(comm);
    return NcclStatus(started, absl::StrCat(who, ": ncclCommInitRankConfig"), detail);
  }
  auto handle =
      std::unique_ptr<NcclComm>(new NcclComm(comm, rank, nranks, device, std::move(done)));
  absl::Status ready = handle->WaitWhileInProgress(deadline, "joining the communicator");
  if (absl::IsDeadlineExceeded(ready)) {
    return absl::DeadlineExceededError(absl::StrCat(
        who, ": the communicator was not complete after ", timeout.count(), " ms: are all ", nranks,
        " ranks running, each with its own rank, the same unique id and their own GPU?"));
  }
  RETURN_IF_ERROR(ready);
  return handle;
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr) return;
  DeviceGuard guard(device_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  ncclResult_t state = ncclCommFinalize(comm_);
  while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(kPollInterval);
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
  }
  if (state == ncclSuccess) {
    ncclCommDestroy(comm_);
  } else {
    ncclCommAbort(comm_);
  }
}

std::string NcclComm::Describe() const {
  return absl::StrCat("NCCL rank ", rank_, " of ", nranks_, " on device ", device_);
}

absl::Status NcclComm::Abort(absl::Status status) {
  if (comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  return status;
}

absl::Status NcclComm::WaitWhileInProgress(std::chrono::steady_clock::time_point deadline,
                                           const char* what) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
    if (queried != ncclSuccess) {
      return Abort(NcclStatus(queried, absl::StrCat(Describe(), ": ncclCommGetAsyncError")));
    }
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      return Abort(NcclStatus(state, absl::StrCat(Describe(), ": ", what), LastError(comm_)));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Abort(absl::DeadlineExceededError(
          absl::StrCat(Describe(), ": ", what, " did not finish before its deadline")));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

absl::Status NcclComm::AllGather(std::span<const AllGatherPart> parts, cudaStream_t stream,
                                 std::chrono::milliseconds timeout) {
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        Describe(), ": the communicator was aborted after an earlier error; ", "create a new one"));
  }
  DeviceGuard guard(device_);
  RETURN_IF_ERROR(guard.status());
  const auto deadline = std::chrono::steady_clock::now() + timeout;

  ncclResult_t result = ncclGroupStart();
  for (const AllGatherPart& part : parts) {
    if (result != ncclSuccess) break;
    result = ncclAllGather(part.send, part.recv, part.bytes_per_rank, ncclUint8, comm_, stream);
  }
  const ncclResult_t ended = ncclGroupEnd();
  if (result == ncclSuccess) result = ended;
  if (result != ncclSuccess && result != ncclInProgress) {
    return Abort(NcclStatus(result, absl::StrCat(Describe(), ": ncclAllGather"), LastError(comm_)));
  }
  // Non-blocking: the group may still be being enqueued.
  RETURN_IF_ERROR(WaitWhileInProgress(deadline, "enqueuing an all-gather"));

  CUDA_RETURN_IF_ERROR(cudaEventRecord(done_.get(), stream), "cudaEventRecord (all-gather)");
  for (;;) {
    const cudaError_t query = cudaEventQuery(done_.get());
    if (query == cudaSuccess) return absl::OkStatus();
    if (query != cudaErrorNotReady) {
      return Abort(CudaStatus(query, absl::StrCat(Describe(), ": waiting for an all-gather")));
    }
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
    if (state != ncclSuccess && state != ncclInProgress) {
      return Abort(NcclStatus(state, absl::StrCat(Describe(), ": all-gather"), LastError(comm_)));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Abort(absl::DeadlineExceededError(absl::StrCat(
          Describe(), ": an all-gather did not complete within ", timeout.count(),
          " ms (a rank stopped, or its stream is blocked); the communicator was aborted")));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

}  // namespace layercast::gpu
