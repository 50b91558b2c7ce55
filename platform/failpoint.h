#pragma once

#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"

namespace layercast {

// Named points where the fault tests (tests/chaos) kill a process, as a
// crash or an OOM kill would, to check that the set recovers from a death
// at exactly that point. Compiled in with the CMake option
// LAYERCAST_FAILPOINTS (on with the tests, off in the image); elsewhere
// FailPoint does nothing.
//
// Armed by the program, first in main, from its environment: a spec NAME
// (LAYERCAST_FAILPOINT=NAME) kills the process the first time it reaches
// NAME; NAME@I only in shard I (a `shard` argument of I); a suffix :N
// (NAME:N, NAME@I:N) the N-th time instead. With a `once_file`
// (LAYERCAST_FAILPOINT_ONCE=FILE) it fires only if FILE does not exist and
// creates it first, so a process restarted with the same environment (as
// Kubernetes restarts a pod) runs on past the point. Null or empty
// arguments arm nothing. Not thread-safe: call before any thread starts.
void ArmFailPoints(const char* spec, const char* once_file);

// The names in use, and what each death tests, are listed in
// docs/recovery.md.
void FailPoint(absl::string_view name, std::optional<uint32_t> shard = std::nullopt);

}  // namespace layercast
