#include "server/pinned_versions.h"

#include <algorithm>

#include "core/log.h"

namespace layercast::server {

PinnedVersions::Kept::~Kept() { budget_.Release(bits_.size()); }

PinnedVersions::PinnedVersions(const ParameterStore& store,
                               std::chrono::steady_clock::duration retention, MemoryBudget& budget,
                               ServerMetrics& metrics)
    : store_(store), retention_(retention), budget_(budget), metrics_(metrics) {}

PinnedVersions::~PinnedVersions() { Drop(); }

void PinnedVersions::Keep(uint32_t layer, uint64_t version, ChangeLog::Snapshot&& before) {
  if (!before.whole()) return;  // a cast failed: there are no values to keep
  std::vector<uint8_t> bits = std::move(before).TakeBits();
  if (!budget_.TryAcquire(bits.size())) {
    metrics_.RecordPinnedVersionDropped("no_room");
    return;
  }
  const AssembledLayout& layout = store_.layout(layer);
  std::vector<uint64_t> offsets;
  uint64_t at = 0;
  for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
    offsets.push_back(at);
    at += store_.owned(layer, t).size() * DTypeSize(layout.tensors()[t].compute_dtype);
  }
  // Charged above; given back by the Kept's destructor from here on.
  std::shared_ptr<const Kept> kept(new Kept(std::move(bits), std::move(offsets), budget_));
  const Key key{layer, version};
  absl::MutexLock lock(&mu_);
  Entry& entry = entries_[key];
  entry.kept = std::move(kept);
  entry.superseded = std::chrono::system_clock::now();
  timers_.Cancel(entry.expiry);
  entry.expiry =
      timers_.Schedule(std::chrono::steady_clock::now() + retention_, [this, key] { Expire(key); });
  ObserveLocked();
}

std::shared_ptr<const PinnedVersions::Kept> PinnedVersions::Find(uint32_t layer,
                                                                 uint64_t version) const {
  absl::MutexLock lock(&mu_);
  const auto it = entries_.find({layer, version});
  return it == entries_.end() ? nullptr : it->second.kept;
}

void PinnedVersions::Expire(Key key) {
  std::shared_ptr<const Kept> dropped;  // released after the lock
  absl::MutexLock lock(&mu_);
  const auto it = entries_.find(key);
  if (it == entries_.end()) return;
  dropped = std::move(it->second.kept);
  entries_.erase(it);
  metrics_.RecordPinnedVersionDropped("expired");
  ObserveLocked();
}

void PinnedVersions::DropAll() {
  if (const size_t dropped = Drop(); dropped > 0) {
    Log()->info("dropped {} kept layer version(s): a stream needed the memory", dropped);
  }
}

size_t PinnedVersions::Drop() {
  std::map<Key, Entry> dropped;  // released after the lock
  absl::MutexLock lock(&mu_);
  dropped.swap(entries_);
  for (auto& [key, entry] : dropped) {
    timers_.Cancel(entry.expiry);
    metrics_.RecordPinnedVersionDropped("reclaimed");
  }
  ObserveLocked();
  return dropped.size();
}

void PinnedVersions::ObserveLocked() {
  uint64_t bytes = 0;
  auto oldest = std::chrono::system_clock::time_point::max();
  for (const auto& [key, entry] : entries_) {
    bytes += entry.kept->bytes();
    oldest = std::min(oldest, entry.superseded);
  }
  metrics_.pinned_version_bytes().Set(static_cast<double>(bytes));
  metrics_.pinned_versions().Set(static_cast<double>(entries_.size()));
  metrics_.pinned_version_oldest_timestamp().Set(
      entries_.empty() ? 0.0 : std::chrono::duration<double>(oldest.time_since_epoch()).count());
}

}  // namespace layercast::server
