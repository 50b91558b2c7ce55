#pragma once

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "server/serving/change_log.h"
#include "server/serving/parameter_store.h"
#include "server/serving/version_gate.h"
#include "server/versions/pinned_versions.h"

namespace layercast::server {

// The one rule for changing a layer's master to a new version, used by the
// optimizer's steps (LayerTrainer) and by publishes (Publications): under
// the layer's lock, held exclusively, the change is made and recorded for
// delta pulls (ChangeLog), what it replaced is kept for pinned readers
// (PinnedVersions), and the layer advances in the VersionGate, last. A
// reader holding the layer's lock shared sees the master and the version
// agree.
//
// What it links (a ParameterStore and a VersionGate always; the change log
// and the pinned versions when the shard keeps them) must outlive it.
// Thread-safe for different layers; one change of a layer at a time is the
// caller's to ensure (LayerTrainer's layer state, Publications' mutex).
class VersionedMaster {
 public:
  struct Links {
    ParameterStore* store = nullptr;
    VersionGate* gate = nullptr;       // null only in unit tests
    ChangeLog* changes = nullptr;      // null: nothing recorded
    PinnedVersions* pinned = nullptr;  // null: nothing kept
  };
  explicit VersionedMaster(Links links) : links_(links) {}

  // Steps `layer` from version `from` to from + 1 by `update`, which writes
  // the layer's master in place, tensor by tensor; while readers want
  // deltas it is given a recording to observe each tensor's write with
  // (ChangeLog::Recording::ForTensor), else null. An error from `update`
  // leaves the version where it was (the caller's to make it all or
  // nothing).
  absl::Status Step(uint32_t layer, uint64_t from,
                    absl::FunctionRef<absl::Status(ChangeLog::Recording*)> update);

  // Replaces `layer`'s master by `values` (one vector per tensor, empty for
  // one this shard owns none of) as version `to`, the layer being at
  // `from`. Returns the owned elements that changed (0 when nothing is
  // recorded).
  uint64_t Replace(uint32_t layer, uint64_t from, uint64_t to,
                   const std::vector<std::vector<float>>& values);
  // The same for a shard brought level: its values jump over versions it
  // never held, so no delta or pinned read may start before the jump.
  void Jump(uint32_t layer, uint64_t to, const std::vector<std::vector<float>>& values);
  // Version `to` leaves `layer` as it was.
  void Keep(uint32_t layer, uint64_t to);

 private:
  void CopyLocked(uint32_t layer, const std::vector<std::vector<float>>& values);

  const Links links_;
};

}  // namespace layercast::server
