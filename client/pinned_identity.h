#pragma once

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace layercast::client {

// What a walk of many layers at one version (GatherOptions.exact_version)
// has read, as an identity rather than a number: per shard, the
// incarnation that served the walk's first layer from it. A version
// number names one set of bits only within one incarnation of a shard (a
// shard restarted without its history counts again, and a publish may
// give the same number other values), so a later layer from another
// incarnation would mix two models under one number.
//
// Thread-safe: a prefetching walk gathers several layers at once.
class PinnedIdentity {
 public:
  // OK when shard `shard` is seen for the first time (it is recorded) or
  // with the incarnation recorded; ABORTED naming both incarnations, the
  // version and `describe` ("shard 1 (host:port)") otherwise.
  absl::Status Check(uint32_t shard, uint64_t incarnation, uint64_t version,
                     absl::string_view describe);

  // Per shard, the incarnation recorded (0: not seen yet).
  std::vector<uint64_t> incarnations() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<uint64_t> incarnations_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::client
