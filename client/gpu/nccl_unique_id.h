#pragma once

#include <nccl.h>

#include <chrono>
#include <string>

#include "absl/status/statusor.h"

namespace layercast::gpu {

// How the K local ranks of one node agree on an NCCL unique id: through a
// file every rank is given the path of. Rank 0 makes the id (ncclGetUniqueId)
// and publishes it atomically (written under a temporary name in the same
// folder, then renamed), so a reader sees all 128 bytes or nothing; the other
// ranks poll for the file until their deadline. Nothing but a path is shared:
// no sockets, no launcher library, no environment variables read here.
//
// The path must be fresh for each job (a folder the launcher makes, or a name
// holding the job id): a file left from an earlier job would send the other
// ranks to a communicator nobody serves, which NcclComm::Create then reports
// as DEADLINE_EXCEEDED at its deadline.

// Writes `id` to `path` atomically. INTERNAL naming the path and errno's text
// if the folder is not writable.
absl::Status WriteNcclUniqueId(const std::string& path, const ncclUniqueId& id);

// Waits up to `timeout` for `path` to appear and reads the id from it.
// DEADLINE_EXCEEDED naming the path when it never appears; DATA_LOSS when it
// does not hold exactly sizeof(ncclUniqueId) (128) bytes.
absl::StatusOr<ncclUniqueId> ReadNcclUniqueId(const std::string& path,
                                              std::chrono::milliseconds timeout);

// Rank 0: a new id, written to `path`. Other ranks: the id read from `path`.
absl::StatusOr<ncclUniqueId> ShareNcclUniqueId(int rank, const std::string& path,
                                               std::chrono::milliseconds timeout);

}  // namespace layercast::gpu
