#include "server/serving/shared_chunks.h"

#include <algorithm>

#include <boost/asio/post.hpp>

namespace layercast::server {

SharedChunks::SharedChunks(uint64_t capacity_bytes, std::chrono::steady_clock::duration max_idle,
                           MemoryBudget& budget, ServerMetrics& metrics,
                           boost::asio::any_io_executor resumes, DeadlineTimers* timers)
    : capacity_bytes_(capacity_bytes),
      max_idle_(max_idle),
      budget_(budget),
      metrics_(metrics),
      resumes_(std::move(resumes)),
      timers_(timers) {
  ScheduleSweep();
}

SharedChunks::~SharedChunks() { DropAll(); }

void SharedChunks::ScheduleSweep() {
  // Twice per max_idle, so nothing stays much longer than that after its
  // workers have gone (a finished job would otherwise leave its last layers
  // charged to the budget until the next miss).
  const auto period =
      std::max<std::chrono::steady_clock::duration>(std::chrono::milliseconds(1), max_idle_ / 2);
  timers_.Schedule(timers_.Now() + period, [this] {
    DropIdle();
    ScheduleSweep();
  });
}

std::optional<absl::StatusOr<CastChunk>> SharedChunks::GetOrCast(const ChunkKey& key,
                                                                 uint64_t bytes, Cast cast,
                                                                 Resume resume) {
  // A lone stream with nothing kept of its layer: no lock, no hash. A
  // stream that begins meanwhile may cast the same chunk once more.
  const Slot& slot = SlotOf(key.layer);
  if (slot.open.load(std::memory_order_acquire) <= 1 &&
      slot.entries.load(std::memory_order_acquire) == 0) {
    return cast();
  }
  std::shared_ptr<Entry> entry;
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    const auto now = timers_.Now();
    if (auto it = entries_.find(key); it != entries_.end()) {
      it->second->last_used = now;
      if (!it->second->ready) {
        it->second->waiting.push_back(std::move(resume));
        return std::nullopt;
      }
      if (it->second->chunk.ok()) metrics_.RecordChunkShared();
      return it->second->chunk;
    }
    if (bytes <= capacity_bytes_ && OthersWantLocked(key.layer)) {
      freed = DropIdleLocked(now, /*all=*/false) + MakeRoomLocked(bytes);
      // Bytes just freed pay for the new chunk first; the budget is asked
      // only for the rest, and never while a stream waits for it.
      const uint64_t reused = std::min(freed, bytes);
      if (budget_.waiting() == 0 && (reused == bytes || budget_.TryAcquire(bytes - reused))) {
        freed -= reused;
        entry = std::make_shared<Entry>();
        entry->bytes = bytes;
        entry->last_used = now;
        entries_.emplace(key, entry);
        SlotOf(key.layer).entries.fetch_add(1, std::memory_order_acq_rel);
        kept_bytes_ += bytes;
      }
    }
    metrics_.shared_chunk_bytes().Set(static_cast<double>(kept_bytes_));
  }
  GiveBack(freed);
  if (entry == nullptr) return cast();  // not worth keeping, or no room

  absl::StatusOr<CastChunk> chunk = cast();
  std::vector<Resume> waiting;
  {
    absl::MutexLock lock(&mu_);
    entry->chunk = chunk;
    entry->ready = true;
    waiting.swap(entry->waiting);
  }
  for (Resume& waiter : waiting) {
    if (chunk.ok()) metrics_.RecordChunkShared();
    boost::asio::post(resumes_, [waiter = std::move(waiter), chunk] { waiter(chunk); });
  }
  // Streams waiting for budget come before sharing; a failure is not kept.
  if (!chunk.ok() || budget_.waiting() > 0) Forget(key, entry);
  return chunk;
}

void SharedChunks::BeginStream(uint32_t layer) {
  absl::MutexLock lock(&mu_);
  ++open_[layer];
  SlotOf(layer).open.fetch_add(1, std::memory_order_acq_rel);
}

void SharedChunks::EndStream(uint32_t layer) {
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = open_.find(layer);
    if (it == open_.end()) return;
    SlotOf(layer).open.fetch_sub(1, std::memory_order_acq_rel);
    if (--it->second > 0) return;
    open_.erase(it);
    // Nobody reads the layer now: what was kept for its readers goes.
    freed = DropLayerLocked(layer);
    metrics_.shared_chunk_bytes().Set(static_cast<double>(kept_bytes_));
  }
  GiveBack(freed);
}

bool SharedChunks::OthersWantLocked(uint32_t layer) const {
  auto it = open_.find(layer);
  return it != open_.end() && it->second > 1;
}

uint64_t SharedChunks::RemoveLocked(
    absl::flat_hash_map<ChunkKey, std::shared_ptr<Entry>>::iterator it) {
  const uint64_t bytes = it->second->bytes;
  kept_bytes_ -= bytes;
  SlotOf(it->first.layer).entries.fetch_sub(1, std::memory_order_acq_rel);
  entries_.erase(it);
  return bytes;
}

uint64_t SharedChunks::DropIdleLocked(std::chrono::steady_clock::time_point now, bool all) {
  uint64_t freed = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (it->second->ready && (all || now - it->second->last_used > max_idle_)) {
      freed += RemoveLocked(it);
    }
    it = next;
  }
  return freed;
}

uint64_t SharedChunks::MakeRoomLocked(uint64_t room) {
  uint64_t freed = 0;
  // Linear scans: the default capacity holds two layers' worth of one
  // shard's chunks (hundreds), and a scan costs far less than one cast.
  while (kept_bytes_ + room > capacity_bytes_) {
    auto least_recent = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (!it->second->ready) continue;
      if (least_recent == entries_.end() ||
          it->second->last_used < least_recent->second->last_used) {
        least_recent = it;
      }
    }
    if (least_recent == entries_.end()) break;  // the rest are being cast
    freed += RemoveLocked(least_recent);
  }
  return freed;
}

void SharedChunks::Forget(const ChunkKey& key, const std::shared_ptr<Entry>& entry) {
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second != entry) return;  // already dropped
    freed = RemoveLocked(it);
    metrics_.shared_chunk_bytes().Set(static_cast<double>(kept_bytes_));
  }
  GiveBack(freed);
}

void SharedChunks::DropAll() { Drop(/*all=*/true); }

void SharedChunks::DropIdle() { Drop(/*all=*/false); }

void SharedChunks::DropLayer(uint32_t layer) {
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    freed = DropLayerLocked(layer);
    metrics_.shared_chunk_bytes().Set(static_cast<double>(kept_bytes_));
  }
  GiveBack(freed);
}

uint64_t SharedChunks::DropLayerLocked(uint32_t layer) {
  uint64_t freed = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (it->first.layer == layer && it->second->ready) freed += RemoveLocked(it);
    it = next;
  }
  return freed;
}

void SharedChunks::Drop(bool all) {
  uint64_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    freed = DropIdleLocked(timers_.Now(), all);
    metrics_.shared_chunk_bytes().Set(static_cast<double>(kept_bytes_));
  }
  GiveBack(freed);
}

void SharedChunks::GiveBack(uint64_t bytes) {
  if (bytes > 0) budget_.Release(bytes);
}

uint64_t SharedChunks::kept_bytes() const {
  absl::MutexLock lock(&mu_);
  return kept_bytes_;
}

}  // namespace layercast::server
