#include "server/versions/versioned_master.h"

#include <cstring>
#include <new>
#include <optional>

#include "platform/log.h"
#include "platform/status_macros.h"

namespace layercast::server {

absl::Status VersionedMaster::Step(uint32_t layer, uint64_t from,
                                   absl::FunctionRef<absl::Status(ChangeLog::Recording*)> update) {
  // Recorded in the update's own pass, and only while readers use it (asked
  // before the layer's lock: Wanted may log).
  const bool record = links_.changes != nullptr && links_.changes->Wanted();
  absl::WriterMutexLock master_lock(&links_.store->layer_mutex(layer));
  std::optional<ChangeLog::Recording> recording;
  if (record) {
    try {
      recording.emplace(
          *links_.changes, layer, links_.pinned != nullptr,
          links_.pinned != nullptr ? links_.pinned->TakeSpare(layer) : std::vector<uint8_t>());
    } catch (const std::bad_alloc&) {
      // Not recorded: delta pulls from before this step fall back to full.
      Log()->warn("no memory to record what step {} of layer {} changes", from + 1, layer);
    }
  }
  RETURN_IF_ERROR(update(recording ? &*recording : nullptr));
  if (recording) {
    const uint64_t changed = recording->Commit(from + 1);
    if (links_.pinned != nullptr) {
      links_.pinned->Keep(layer, from, changed, std::move(*recording).TakeBefore());
    }
  }
  if (links_.gate != nullptr) links_.gate->Advance(layer, from + 1);
  return absl::OkStatus();
}

uint64_t VersionedMaster::Replace(uint32_t layer, uint64_t from, uint64_t to,
                                  const std::vector<std::vector<float>>& values) {
  absl::WriterMutexLock master_lock(&links_.store->layer_mutex(layer));
  std::optional<ChangeLog::Snapshot> before;
  if (links_.changes != nullptr) {
    try {
      before = links_.changes->Take(layer);
    } catch (const std::bad_alloc&) {
      Log()->warn("no memory to record what version {} changes in layer {}", to, layer);
    }
  }
  CopyLocked(layer, values);
  uint64_t changed = 0;
  if (before) {
    changed = links_.changes->Record(layer, to, *before);
    if (links_.pinned != nullptr) links_.pinned->Keep(layer, from, changed, *std::move(before));
  }
  if (links_.gate != nullptr) links_.gate->Advance(layer, to);
  return changed;
}

void VersionedMaster::Jump(uint32_t layer, uint64_t to,
                           const std::vector<std::vector<float>>& values) {
  absl::WriterMutexLock master_lock(&links_.store->layer_mutex(layer));
  if (links_.changes != nullptr) links_.changes->Forget(layer);
  CopyLocked(layer, values);
  if (links_.gate != nullptr) links_.gate->Advance(layer, to);
}

void VersionedMaster::Keep(uint32_t layer, uint64_t to) {
  absl::WriterMutexLock master_lock(&links_.store->layer_mutex(layer));
  if (links_.changes != nullptr) links_.changes->RecordUnchanged(layer, to);
  if (links_.gate != nullptr) links_.gate->Advance(layer, to);
}

void VersionedMaster::CopyLocked(uint32_t layer, const std::vector<std::vector<float>>& values) {
  for (uint32_t t = 0; t < values.size(); ++t) {
    // A tensor this shard owns none of has no values (and no data()).
    if (values[t].empty()) continue;
    std::memcpy(links_.store->mutable_master(layer, t), values[t].data(),
                values[t].size() * sizeof(float));
  }
}

}  // namespace layercast::server
