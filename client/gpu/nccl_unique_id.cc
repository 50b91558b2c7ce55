#include "client/gpu/nccl_unique_id.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/gpu/cuda_status.h"

namespace layercast::gpu {
namespace {

std::string ErrnoText() { return std::strerror(errno); }

}  // namespace

absl::Status WriteNcclUniqueId(const std::string& path, const ncclUniqueId& id) {
  const std::string temp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("cannot create ", temp, " for the NCCL unique id: ", ErrnoText()));
  }
  const ssize_t written = ::write(fd, &id, sizeof(id));
  const std::string write_error = ErrnoText();
  const bool closed = ::close(fd) == 0;
  if (written != static_cast<ssize_t>(sizeof(id)) || !closed) {
    ::unlink(temp.c_str());
    return absl::InternalError(absl::StrCat("cannot write the NCCL unique id to ", temp, ": ",
                                            written < 0 ? write_error : "short write"));
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string error = ErrnoText();
    ::unlink(temp.c_str());
    return absl::InternalError(absl::StrCat("cannot rename ", temp, " to ", path, ": ", error));
  }
  return absl::OkStatus();
}

absl::StatusOr<ncclUniqueId> ReadNcclUniqueId(const std::string& path,
                                              std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ncclUniqueId id;
      struct stat info = {};
      const bool sized = ::fstat(fd, &info) == 0 && info.st_size == static_cast<off_t>(sizeof(id));
      const bool read_all =
          sized && ::read(fd, &id, sizeof(id)) == static_cast<ssize_t>(sizeof(id));
      ::close(fd);
      if (!read_all) {
        return absl::DataLossError(absl::StrCat(path, " does not hold an NCCL unique id: it has ",
                                                info.st_size, " bytes, not ", sizeof(id)));
      }
      return id;
    }
    if (errno != ENOENT) {
      return absl::InternalError(absl::StrCat("cannot open ", path, ": ", ErrnoText()));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no NCCL unique id at ", path, " after ", timeout.count(),
                       " ms: is rank 0 running, and given the same path?"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

absl::StatusOr<ncclUniqueId> ShareNcclUniqueId(int rank, const std::string& path,
                                               std::chrono::milliseconds timeout) {
  if (rank != 0) return ReadNcclUniqueId(path, timeout);
  ncclUniqueId id;
  const ncclResult_t result = ncclGetUniqueId(&id);
  if (result != ncclSuccess) {
    return NcclStatus(result, "ncclGetUniqueId", ncclGetLastError(nullptr));
  }
  if (absl::Status written = WriteNcclUniqueId(path, id); !written.ok()) return written;
  return id;
}

}  // namespace layercast::gpu
