#include "server/shared_chunks.h"

#include <algorithm>
#include <limits>

namespace layercast::server {

SharedChunks::SharedChunks(uint64_t capacity_bytes, std::chrono::steady_clock::duration max_age,
                           MemoryBudget& budget, ServerMetrics& metrics)
    : capacity_bytes_(capacity_bytes), max_age_(max_age), budget_(budget), metrics_(metrics) {}

SharedChunks::~SharedChunks() { DropAll(); }

absl::StatusOr<CastChunk> SharedChunks::GetOrCast(const ChunkKey& key, uint64_t bytes,
                                                  const std::string& peer, Cast cast) {
  std::shared_ptr<Entry> entry;
  bool cast_here = false;
  uint64_t evicted = 0;
  {
    absl::MutexLock lock(&mu_);
    const auto now = std::chrono::steady_clock::now();
    if (auto it = entries_.find(key); it != entries_.end()) {
      entry = it->second;
      entry->last_used = now;
    } else if (bytes <= capacity_bytes_ && OthersWantLocked(key.layer, peer, now)) {
      evicted = EvictLocked(bytes, now);
      if (kept_bytes_ + bytes <= capacity_bytes_ && budget_.TryAcquire(bytes)) {
        entry = std::make_shared<Entry>();
        entry->bytes = bytes;
        entry->last_used = now;
        entries_.emplace(key, entry);
        kept_bytes_ += bytes;
        cast_here = true;
      }
    }
    metrics_.shared_chunk_bytes().Set(static_cast<double>(kept_bytes_));
  }
  GiveBack(evicted);

  if (entry == nullptr) {  // no room to keep it: cast for this stream alone
    metrics_.RecordChunkCast();
    return cast();
  }
  if (!cast_here) {
    metrics_.RecordChunkShared();
    entry->ready.WaitForNotification();
    return entry->chunk;
  }
  metrics_.RecordChunkCast();
  entry->chunk = cast();
  entry->ready.Notify();
  // Streams waiting for budget come before sharing; a failure is not kept.
  if (!entry->chunk.ok() || budget_.waiting() > 0) Forget(key, entry);
  return entry->chunk;
}

void SharedChunks::BeginStream(uint32_t layer, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  const auto now = std::chrono::steady_clock::now();
  std::vector<Reader>& readers = readers_[layer];
  std::erase_if(readers, [&](const Reader& r) {
    return r.open == 0 && now - r.last_seen > max_age_ && r.peer != peer;
  });
  auto it =
      std::find_if(readers.begin(), readers.end(), [&](const Reader& r) { return r.peer == peer; });
  if (it == readers.end())
    it = readers.insert(readers.end(), Reader{.peer = peer, .open = 0, .last_seen = now});
  ++it->open;
  it->last_seen = now;
}

void SharedChunks::EndStream(uint32_t layer, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto layer_readers = readers_.find(layer);
  if (layer_readers == readers_.end()) return;
  for (Reader& reader : layer_readers->second) {
    if (reader.peer != peer) continue;
    reader.open = std::max(0, reader.open - 1);
    reader.last_seen = std::chrono::steady_clock::now();
  }
}

bool SharedChunks::OthersWantLocked(uint32_t layer, const std::string& peer,
                                    std::chrono::steady_clock::time_point now) {
  auto layer_readers = readers_.find(layer);
  if (layer_readers == readers_.end()) return false;
  return std::any_of(layer_readers->second.begin(), layer_readers->second.end(),
                     [&](const Reader& r) {
                       return r.peer != peer && (r.open > 0 || now - r.last_seen <= max_age_);
                     });
}

uint64_t SharedChunks::EvictLocked(uint64_t room, std::chrono::steady_clock::time_point now) {
  uint64_t evicted = 0;
  const auto remove = [&](auto it) {
    evicted += it->second->bytes;
    kept_bytes_ -= it->second->bytes;
    entries_.erase(it);
  };
  for (auto it = entries_.begin(); it != entries_.end();) {
    auto next = std::next(it);
    if (it->second->ready.HasBeenNotified() &&
        (room == std::numeric_limits<uint64_t>::max() || now - it->second->last_used > max_age_)) {
      remove(it);
    }
    it = next;
  }
  // Least recently used first. Linear scans: a cache holds tens of chunks, and each scan
  // costs far less than casting one.
  while (kept_bytes_ + room > capacity_bytes_ && room <= capacity_bytes_) {
    auto oldest = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (!it->second->ready.HasBeenNotified()) continue;
      if (oldest == entries_.end() || it->second->last_used < oldest->second->last_used)
        oldest = it;
    }
    if (oldest == entries_.end()) break;  // the rest are being cast
    remove(oldest);
  }
  return evicted;
}

void SharedChunks::Forget(const ChunkKey& key, const std::shared_ptr<Entry>& entry) {
  uint64_t evicted = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end() || it->second != entry) return;  // already dropped
    evicted = entry->bytes;
    kept_bytes_ -= entry->bytes;
    entries_.erase(it);
    metrics_.shared_chunk_bytes().Set(static_cast<double>(kept_bytes_));
  }
  GiveBack(evicted);
}

void SharedChunks::DropAll() {
  uint64_t evicted = 0;
  {
    absl::MutexLock lock(&mu_);
    evicted = EvictLocked(std::numeric_limits<uint64_t>::max(), std::chrono::steady_clock::now());
    metrics_.shared_chunk_bytes().Set(static_cast<double>(kept_bytes_));
  }
  GiveBack(evicted);
}

void SharedChunks::GiveBack(uint64_t bytes) {
  if (bytes > 0) budget_.Release(bytes);
}

uint64_t SharedChunks::kept_bytes() const {
  absl::MutexLock lock(&mu_);
  return kept_bytes_;
}

}  // namespace layercast::server
