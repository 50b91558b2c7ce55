#include "server/versions/pinned_versions.h"

#include <algorithm>
#include <atomic>

#include "platform/log.h"

namespace layercast::server {

PinnedVersions::Kept::~Kept() { budget_.Release(bits_.size()); }

PinnedVersions::PinnedVersions(const ParameterStore& store,
                               std::chrono::steady_clock::duration retention, size_t per_layer,
                               MemoryBudget& budget, ServerMetrics& metrics, DeadlineTimers* timers)
    : store_(store),
      retention_(retention),
      per_layer_(per_layer),
      budget_(budget),
      metrics_(metrics),
      timers_(timers) {}

void PinnedVersions::Lease(uint64_t version) {
  const auto now = timers_.Now();
  absl::MutexLock lock(&mu_);
  // As many as versions read within the last `retention` (a walk reads
  // one, a mirror one per update): the scan is short.
  std::erase_if(leases_, [now](const auto& lease) { return lease.second <= now; });
  leases_[version] = now + retention_;
}

std::optional<std::chrono::steady_clock::time_point> PinnedVersions::LeasedUntilLocked(
    std::map<Key, Entry>::const_iterator entry, std::chrono::steady_clock::time_point now) const {
  // The entry serves the versions after the layer's kept one before it, up
  // to its own (Find: the first kept version at or after the one asked).
  const auto first = entries_.lower_bound({entry->first.first, 0});
  const uint64_t from = entry == first ? 0 : std::prev(entry)->first.second + 1;
  std::optional<std::chrono::steady_clock::time_point> until;
  for (auto lease = leases_.lower_bound(from);
       lease != leases_.end() && lease->first <= entry->first.second; ++lease) {
    if (lease->second > now && (!until || lease->second > *until)) until = lease->second;
  }
  return until;
}

void PinnedVersions::EvictLocked(uint32_t layer,
                                 std::vector<std::shared_ptr<const Kept>>& evicted) {
  const auto now = timers_.Now();
  const auto first = entries_.lower_bound({layer, 0});
  const auto end = entries_.lower_bound({layer + 1, 0});
  std::vector<std::map<Key, Entry>::iterator> leased, unleased;  // oldest first
  for (auto it = first; it != end; ++it) {
    (LeasedUntilLocked(it, now) ? leased : unleased).push_back(it);
  }
  // The oldest of each kind beyond per_layer_ go: leases keep a slow walk's
  // version beside the newest, and cannot keep more than as many again.
  std::vector<std::map<Key, Entry>::iterator> going;
  for (auto* kind : {&unleased, &leased}) {
    if (kind->size() > per_layer_)
      going.insert(going.end(), kind->begin(), kind->end() - per_layer_);
  }
  for (const auto& it : going) {
    std::shared_ptr<const Kept> kept = std::move(it->second.kept);
    timers_.Cancel(it->second.expiry);
    entries_.erase(it);
    metrics_.RecordPinnedVersionDropped("evicted");
    // Only the map held it, and Find cannot hand it out now (the lock): its
    // bytes move to the spare with their charge (the Kept releases none),
    // counted in the gauge until the next snapshot takes them or the
    // layer's last version expires.
    if (kept.use_count() == 1 && spare_[layer].empty()) {
      // use_count() is a relaxed load: the last reader's reads of the bytes
      // happen before the next snapshot writes into them only with this.
      std::atomic_thread_fence(std::memory_order_acquire);
      spare_[layer] = std::move(const_cast<Kept&>(*kept).bits_);
    }
    evicted.push_back(std::move(kept));
  }
}

PinnedVersions::~PinnedVersions() {
  std::map<Key, Entry> dropped;  // released after the lock
  absl::MutexLock lock(&mu_);
  dropped = TakeAllLocked();
  ReleaseSparesLocked();
}

void PinnedVersions::ReleaseSparesLocked() {
  uint64_t bytes = 0;
  for (const auto& [layer, spare] : spare_) bytes += spare.size();
  spare_.clear();
  budget_.Release(bytes);
  ObserveLocked();
}

bool PinnedVersions::Affordable(uint64_t bytes) const {
  const std::optional<uint64_t> budget = budget_.budget();
  if (!budget) return true;
  const uint64_t in_use = budget_.in_use();
  return in_use <= *budget && *budget - in_use >= 2 * bytes;
}

void PinnedVersions::Keep(uint32_t layer, uint64_t version, uint64_t changed,
                          ChangeLog::Snapshot&& before) {
  // Unchanged, the next kept version or the master has the same bits; a
  // failed cast left none to keep.
  if (changed == 0 || !before.whole()) return;
  std::vector<uint8_t> bits = std::move(before).TakeBits();
  if (!Affordable(bits.size()) || !budget_.TryAcquire(bits.size())) {
    metrics_.RecordPinnedVersionDropped("no_room");
    return;
  }
  const AssembledLayout& layout = store_.layout(layer);
  std::vector<uint64_t> offsets;
  uint64_t at = 0;
  for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
    offsets.push_back(at);
    at += store_.owned(layer, t).size() * DTypeSize(KeptDType(layout.tensors()[t].compute_dtype));
  }
  // Charged above; given back by the Kept's destructor from here on.
  std::shared_ptr<const Kept> kept(new Kept(std::move(bits), std::move(offsets), budget_));
  std::vector<std::shared_ptr<const Kept>> evicted;  // released after the lock
  absl::MutexLock lock(&mu_);
  const Key key{layer, version};
  Entry& entry = entries_[key];
  entry.kept = std::move(kept);
  entry.superseded = std::chrono::system_clock::now();
  timers_.Cancel(entry.expiry);
  entry.expiry = timers_.Schedule(timers_.Now() + retention_, [this, key] { Expire(key); });
  EvictLocked(layer, evicted);
  ObserveLocked();
}

std::shared_ptr<const PinnedVersions::Kept> PinnedVersions::Find(uint32_t layer, uint64_t version,
                                                                 const ChangeLog& changes) const {
  absl::MutexLock lock(&mu_);
  // The first kept version at or after `version`: if a later one is not
  // the same bits, no later one is.
  const auto it = entries_.lower_bound({layer, version});
  if (it == entries_.end() || it->first.first != layer) return nullptr;
  if (it->first.second == version || changes.ChangedNothing(layer, version, it->first.second)) {
    return it->second.kept;
  }
  return nullptr;
}

void PinnedVersions::Expire(Key key) {
  std::shared_ptr<const Kept> dropped;  // released after the lock
  absl::MutexLock lock(&mu_);
  const auto it = entries_.find(key);
  if (it == entries_.end()) return;
  if (const auto until = LeasedUntilLocked(it, timers_.Now()); until) {
    // A reader's walk still holds it: until its lease runs out.
    it->second.expiry = timers_.Schedule(*until, [this, key] { Expire(key); });
    return;
  }
  dropped = std::move(it->second.kept);
  entries_.erase(it);
  metrics_.RecordPinnedVersionDropped("expired");
  // A layer no longer stepped keeps no spare either: retention bounds both.
  const auto next = entries_.lower_bound({key.first, 0});
  if (next == entries_.end() || next->first.first != key.first) {
    if (const auto spare = spare_.find(key.first); spare != spare_.end()) {
      budget_.Release(spare->second.size());
      spare_.erase(spare);
    }
  }
  ObserveLocked();
}

std::vector<uint8_t> PinnedVersions::TakeSpare(uint32_t layer) {
  std::vector<uint8_t> spare;
  {
    absl::MutexLock lock(&mu_);
    const auto it = spare_.find(layer);
    if (it == spare_.end()) return spare;
    spare = std::move(it->second);
    spare_.erase(it);
    ObserveLocked();
  }
  budget_.Release(spare.size());
  return spare;
}

void PinnedVersions::DropAll() {
  std::map<Key, Entry> dropped;  // released after the lock
  {
    absl::MutexLock lock(&mu_);
    dropped = TakeAllLocked();
    ReleaseSparesLocked();
    for (size_t i = 0; i < dropped.size(); ++i) metrics_.RecordPinnedVersionDropped("reclaimed");
  }
  if (!dropped.empty()) {
    Log()->info("dropped {} kept layer version(s): a stream needed the memory", dropped.size());
  }
}

std::map<PinnedVersions::Key, PinnedVersions::Entry> PinnedVersions::TakeAllLocked() {
  std::map<Key, Entry> taken;
  taken.swap(entries_);
  for (auto& [key, entry] : taken) timers_.Cancel(entry.expiry);
  ObserveLocked();
  return taken;
}

void PinnedVersions::ObserveLocked() {
  uint64_t bytes = 0;
  auto oldest = std::chrono::system_clock::time_point::max();
  for (const auto& [key, entry] : entries_) {
    bytes += entry.kept->bytes();
    oldest = std::min(oldest, entry.superseded);
  }
  for (const auto& [layer, spare] : spare_) bytes += spare.size();
  metrics_.pinned_version_bytes().Set(static_cast<double>(bytes));
  metrics_.pinned_versions().Set(static_cast<double>(entries_.size()));
  metrics_.pinned_version_oldest_timestamp().Set(
      entries_.empty() ? 0.0 : std::chrono::duration<double>(oldest.time_since_epoch()).count());
}

}  // namespace layercast::server
