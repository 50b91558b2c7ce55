#include "relay/relayed_versions.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <utility>

#include "core/changed_bits.h"
#include "core/dtype.h"
#include "core/fp8.h"
#include "wire/incarnation.h"

namespace layercast::relay {
namespace {

ChangedElements Changes(const AssembledLayout& layout, const uint8_t* now, const uint8_t* was) {
  ChangedElements changed(layout.tensors().size());
  for (size_t t = 0; t < layout.tensors().size(); ++t) {
    const AssembledTensor& tensor = layout.tensors()[t];
    MarkChangedBits(now + tensor.byte_offset, was + tensor.byte_offset, tensor.num_elements,
                    DTypeSize(tensor.compute_dtype), changed.elements[t]);
    if (tensor.block_size != 0) {
      MarkChangedBits(now + tensor.scale_offset, was + tensor.scale_offset,
                      Fp8BlockCount(tensor.num_elements, tensor.block_size), sizeof(float),
                      changed.scales[t]);
    }
  }
  return changed;
}

// Marks in `into` what `from` marks: changes over several versions are the
// union of each version's (both bitmaps of the same tensor).
void Or(const std::vector<uint64_t>& from, std::vector<uint64_t>& into) {
  for (size_t w = 0; w < from.size(); ++w) into[w] |= from[w];
}

// Calls run(first, count) for each run of set bits in `bits`, in order.
// Runs, not bits: a publish that moves a whole tensor is one memcpy.
template <typename Run>
void ForEachRun(const std::vector<uint64_t>& bits, Run run) {
  uint64_t begin = 0, count = 0;
  for (size_t w = 0; w < bits.size(); ++w) {
    uint64_t word = bits[w];
    uint64_t bit = 0;
    while (word != 0) {
      const int zeros = std::countr_zero(word);
      bit += zeros;
      word >>= zeros;
      const int ones = word == ~uint64_t{0} ? 64 : std::countr_one(word);
      const uint64_t first = w * 64 + bit;
      if (count != 0 && begin + count == first) {
        count += ones;
      } else {
        if (count != 0) run(begin, count);
        begin = first;
        count = ones;
      }
      bit += ones;
      word = ones == 64 ? 0 : word >> ones;
    }
  }
  if (count != 0) run(begin, count);
}

// Calls on(offset, element size, marked) for each region of a layer's
// bytes `changed` has bitmaps for: every tensor's elements, then an 8-bit
// float tensor's block scales.
template <typename On>
void ForEachRegion(const AssembledLayout& layout, const ChangedElements& changed, On on) {
  for (size_t t = 0; t < layout.tensors().size(); ++t) {
    const AssembledTensor& tensor = layout.tensors()[t];
    on(tensor.byte_offset, DTypeSize(tensor.compute_dtype), changed.elements[t]);
    if (tensor.block_size != 0) on(tensor.scale_offset, sizeof(float), changed.scales[t]);
  }
}

uint64_t UndoBytes(const AssembledLayout& layout, const ChangedElements& changed) {
  uint64_t bytes = 0;
  ForEachRegion(layout, changed, [&](uint64_t, size_t size, const std::vector<uint64_t>& bits) {
    for (const uint64_t word : bits) bytes += std::popcount(word) * size;
  });
  return bytes;
}

// The values of `bytes` at what `changed` marks, into `undo`.
void Gather(const AssembledLayout& layout, const ChangedElements& changed, const uint8_t* bytes,
            uint8_t* undo) {
  ForEachRegion(layout, changed,
                [&](uint64_t offset, size_t size, const std::vector<uint64_t>& bits) {
                  ForEachRun(bits, [&](uint64_t first, uint64_t count) {
                    std::memcpy(undo, bytes + offset + first * size, count * size);
                    undo += count * size;
                  });
                });
}

// Gather's inverse: `undo` back into `bytes` at what `changed` marks.
void Scatter(const AssembledLayout& layout, const ChangedElements& changed, const uint8_t* undo,
             uint8_t* bytes) {
  ForEachRegion(layout, changed,
                [&](uint64_t offset, size_t size, const std::vector<uint64_t>& bits) {
                  ForEachRun(bits, [&](uint64_t first, uint64_t count) {
                    std::memcpy(bytes + offset + first * size, undo, count * size);
                    undo += count * size;
                  });
                });
}

}  // namespace

RelayedVersions::RelayedVersions(const std::vector<AssembledLayout>& layouts, uint32_t keep)
    : layouts_(layouts), keep_(keep), layers_(layouts.size()) {}

std::shared_ptr<std::vector<uint8_t>> RelayedVersions::Allocate(size_t bytes) const {
  if (budget_ == nullptr) return std::make_shared<std::vector<uint8_t>>(bytes);
  budget_->Charge(bytes);
  server::MemoryBudget* budget = budget_;
  return std::shared_ptr<std::vector<uint8_t>>(new std::vector<uint8_t>(bytes),
                                               [budget, bytes](std::vector<uint8_t>* held) {
                                                 delete held;
                                                 budget->Release(bytes);
                                               });
}

std::shared_ptr<const ChangedElements> RelayedVersions::Count(ChangedElements changed) const {
  if (budget_ == nullptr) return std::make_shared<const ChangedElements>(std::move(changed));
  uint64_t bytes = 0;
  for (size_t t = 0; t < changed.elements.size(); ++t) {
    bytes += (changed.elements[t].size() + changed.scales[t].size()) * sizeof(uint64_t);
  }
  budget_->Charge(bytes);
  server::MemoryBudget* budget = budget_;
  return std::shared_ptr<const ChangedElements>(new ChangedElements(std::move(changed)),
                                                [budget, bytes](const ChangedElements* kept) {
                                                  delete kept;
                                                  budget->Release(bytes);
                                                });
}

void RelayedVersions::Heading(uint64_t version) {
  absl::MutexLock lock(&mu_);
  heading_ = std::max(heading_, version);
}

void RelayedVersions::Put(uint32_t layer, uint64_t version, bool changed,
                          std::span<const uint8_t> bytes, std::vector<uint64_t> incarnations) {
  // Only this thread (the mirror's) writes, so the entries it reads outside
  // the lock stay as they are; readers hold the lock only to take a
  // reference, and wait for no comparison or copy but the in-place write.
  const AssembledLayout& layout = layouts_[layer];
  Kept kept{{version, nullptr, std::move(incarnations), 0}, false, nullptr, nullptr, {}};
  // What its changes are from: the newest kept, or the one before it when
  // the newest is pulled again (a torn pull repaired); nothing after the
  // shards restarted.
  bool had = false, restart = false, repair = false;
  std::shared_ptr<const std::vector<uint8_t>> base;
  {
    absl::ReaderMutexLock lock(&mu_);
    const std::deque<Kept>& held = layers_[layer];
    had = !held.empty();
    if (had) {
      restart = wire::OtherIncarnations(held.back().held.incarnations, kept.held.incarnations);
      repair = !restart && held.back().held.version >= version;
      if (!restart && !repair) base = held.back().held.bytes;
    }
  }
  if (repair) base = BeforeNewest(layer);
  if (!changed && had && !restart) {
    // The newest's values: a version that changed nothing shares them, and a
    // repaired pull keeps the changes of the entry it replaces.
    absl::MutexLock lock(&mu_);
    const Kept& newest = layers_[layer].back();
    kept.unchanged = !repair || newest.unchanged;
    if (repair) {
      kept.changed = newest.changed;
      kept.undo = newest.undo;
    }
    base.reset();
  } else if (base != nullptr && keep_ > 0) {
    ChangedElements moved = Changes(layout, bytes.data(), base->data());
    std::shared_ptr<std::vector<uint8_t>> undo = Allocate(UndoBytes(layout, moved));
    Gather(layout, moved, base->data(), undo->data());
    kept.changed = Count(std::move(moved));
    kept.undo = std::move(undo);
  }
  base.reset();  // a reference of its own would force a copy below

  // The newest's bytes are written in place when no stream sends them;
  // else the new go into a buffer of their own and the streams keep the
  // old until they end (copy on write). Rare: a layer changes once a
  // publish, and its streams take milliseconds.
  const bool write = changed || !had;
  std::shared_ptr<std::vector<uint8_t>> fresh;
  if (write) {
    bool in_place = false;
    {
      absl::ReaderMutexLock lock(&mu_);
      const std::deque<Kept>& held = layers_[layer];
      in_place = had && held.back().held.bytes.use_count() == 1 &&
                 held.back().held.bytes->size() == bytes.size();
    }
    if (!in_place) {
      fresh = Allocate(bytes.size());
      std::memcpy(fresh->data(), bytes.data(), bytes.size());
    }
  }

  absl::MutexLock lock(&mu_);
  std::deque<Kept>& held = layers_[layer];
  if (write && fresh == nullptr) {
    std::shared_ptr<const std::vector<uint8_t>>& live = held.back().held.bytes;
    if (live.use_count() == 1) {
      // use_count() is a relaxed load: the fence orders the last stream's
      // reads of these bytes (before its releasing decrement, often on a
      // gRPC thread dropping its slice) before this write.
      std::atomic_thread_fence(std::memory_order_acquire);
      // Under the lock, so no reader sees a version's number on another's
      // bits. A memcpy into warm memory is the cheapest write there is
      // (measured against copying only what moved: 1.0-1.4x faster).
      std::memcpy(std::const_pointer_cast<std::vector<uint8_t>>(live)->data(), bytes.data(),
                  bytes.size());
    } else {  // a stream took it since: rare, and a copy
      fresh = Allocate(bytes.size());
      std::memcpy(fresh->data(), bytes.data(), bytes.size());
    }
  }
  if (had && fresh != nullptr && !restart && !repair) {
    // Its streams still hold its old bytes: a pinned read shares them.
    held.back().rebuilt = held.back().held.bytes;
  }
  if (had) kept.held.bytes = std::move(held.back().held.bytes);
  if (fresh != nullptr) kept.held.bytes = std::move(fresh);
  kept.held.entry = next_entry_++;
  if (!held.empty() &&
      !wire::OtherIncarnations(held.back().held.incarnations, kept.held.incarnations)) {
    // A shard that sent nothing of this pull (its slice unchanged) named
    // no incarnation: it is the one that cast the version before.
    for (size_t shard = 0; shard < kept.held.incarnations.size(); ++shard) {
      if (kept.held.incarnations[shard] == 0 && shard < held.back().held.incarnations.size()) {
        kept.held.incarnations[shard] = held.back().held.incarnations[shard];
      }
    }
  }
  // The newest incarnations any layer landed from: what is served.
  if (current_.size() < kept.held.incarnations.size()) {
    current_.resize(kept.held.incarnations.size(), 0);
  }
  for (size_t shard = 0; shard < kept.held.incarnations.size(); ++shard) {
    if (kept.held.incarnations[shard] != 0) current_[shard] = kept.held.incarnations[shard];
  }
  if (restart) {
    // A version is an identity only with the incarnations that cast it:
    // what the restarted shards serve under an old number is other bits.
    const uint64_t newest = held.back().held.version;
    held.clear();
    if (version < newest) heading_ = std::min(heading_, version);
  }
  if (repair) held.pop_back();
  if (held.empty()) {
    kept.unchanged = false;
    kept.changed = nullptr;
    kept.undo = nullptr;
  }
  held.push_back(std::move(kept));
  while (held.size() > keep_ + 1) {
    held.pop_front();
    // The oldest kept is rebuilt by no log of its own.
    held.front().changed = nullptr;
    held.front().undo = nullptr;
    held.front().unchanged = false;
  }
  heading_ = std::max(heading_, version);
}

uint64_t RelayedVersions::WaitHeading(uint64_t min_version, absl::Time deadline, uint32_t shard,
                                      std::optional<uint64_t> incarnation) const {
  const auto reached = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    if (heading_ >= min_version || closed_) return true;
    const uint64_t held = IncarnationOfLocked(shard);
    return incarnation && held != 0 && held != *incarnation;
  };
  absl::ReaderMutexLock lock(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(&reached), deadline);
  return heading_;
}

uint64_t RelayedVersions::IncarnationOf(uint32_t shard) const {
  absl::ReaderMutexLock lock(&mu_);
  return IncarnationOfLocked(shard);
}

uint64_t RelayedVersions::IncarnationOfLocked(uint32_t shard) const {
  return shard < current_.size() ? current_[shard] : 0;
}

uint64_t RelayedVersions::heading() const {
  absl::ReaderMutexLock lock(&mu_);
  return heading_;
}

uint64_t RelayedVersions::held() const {
  absl::ReaderMutexLock lock(&mu_);
  uint64_t lowest = UINT64_MAX;
  for (const std::deque<Kept>& held : layers_) {
    lowest = std::min(lowest, held.empty() ? 0 : held.back().held.version);
  }
  return layers_.empty() ? 0 : lowest;
}

std::optional<HeldLayer> RelayedVersions::WaitNewest(uint32_t layer, uint64_t min_version,
                                                     absl::Time deadline) const {
  // A layer of incarnations older than the newest landed waits for its
  // pull from the new ones: its number may name other bits now.
  const auto reached = [this, layer, min_version]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return closed_ ||
           (!layers_[layer].empty() && layers_[layer].back().held.version >= min_version &&
            !wire::OtherIncarnations(layers_[layer].back().held.incarnations, current_));
  };
  absl::ReaderMutexLock lock(&mu_);
  if (!mu_.AwaitWithDeadline(absl::Condition(&reached), deadline) || closed_) {
    return std::nullopt;
  }
  return layers_[layer].back().held;
}

std::optional<size_t> RelayedVersions::IndexOf(const std::deque<Kept>& kept,
                                               uint64_t version) const {
  for (size_t i = 0; i < kept.size(); ++i) {
    if (kept[i].held.version == version) return i;
  }
  return std::nullopt;
}

std::shared_ptr<const std::vector<uint8_t>> RelayedVersions::BytesOf(uint32_t layer,
                                                                     uint64_t entry) const {
  struct Log {
    std::shared_ptr<const ChangedElements> changed;
    std::shared_ptr<const std::vector<uint8_t>> undo;
  };
  std::shared_ptr<const std::vector<uint8_t>> newest;
  std::vector<Log> logs;  // newest first
  {
    absl::ReaderMutexLock lock(&mu_);
    const std::deque<Kept>& kept = layers_[layer];
    size_t index = 0;
    while (index < kept.size() && kept[index].held.entry != entry) ++index;
    if (index == kept.size()) return nullptr;  // evicted or replaced
    if (index + 1 == kept.size()) return kept.back().held.bytes;
    if (std::shared_ptr<const std::vector<uint8_t>> rebuilt = kept[index].rebuilt.lock()) {
      return rebuilt;
    }
    newest = kept.back().held.bytes;
    for (size_t i = kept.size() - 1; i > index; --i) {
      if (!kept[i].unchanged) logs.push_back({kept[i].changed, kept[i].undo});
    }
  }
  if (logs.empty()) return newest;  // nothing changed since: its bytes
  // Outside the lock: the reference taken to the newest keeps Put from
  // writing it in place meanwhile.
  std::shared_ptr<std::vector<uint8_t>> rebuilt = Allocate(newest->size());
  std::memcpy(rebuilt->data(), newest->data(), newest->size());
  for (const Log& log : logs) {
    Scatter(layouts_[layer], *log.changed, log.undo->data(), rebuilt->data());
  }
  absl::MutexLock lock(&mu_);
  for (const Kept& k : layers_[layer]) {
    if (k.held.entry == entry) k.rebuilt = rebuilt;
  }
  return rebuilt;
}

std::shared_ptr<const std::vector<uint8_t>> RelayedVersions::BeforeNewest(uint32_t layer) const {
  uint64_t entry = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    const std::deque<Kept>& kept = layers_[layer];
    if (kept.size() < 2) return nullptr;
    entry = kept[kept.size() - 2].held.entry;
  }
  return BytesOf(layer, entry);
}

std::optional<HeldLayer> RelayedVersions::Identity(uint32_t layer, uint64_t version) const {
  absl::ReaderMutexLock lock(&mu_);
  const std::optional<size_t> i = IndexOf(layers_[layer], version);
  if (!i || wire::OtherIncarnations(layers_[layer][*i].held.incarnations, current_))
    return std::nullopt;
  HeldLayer at = layers_[layer][*i].held;
  at.bytes = nullptr;
  return at;
}

std::optional<HeldLayer> RelayedVersions::At(uint32_t layer, uint64_t version) const {
  std::optional<HeldLayer> at = Identity(layer, version);
  if (!at) return std::nullopt;
  at->bytes = BytesOf(layer, at->entry);
  if (at->bytes == nullptr) return std::nullopt;  // evicted meanwhile
  return at;
}

std::shared_ptr<const ChangedElements> RelayedVersions::ChangedBetween(
    uint32_t layer, uint64_t base, const HeldLayer& target) const {
  absl::ReaderMutexLock lock(&mu_);
  const std::deque<Kept>& kept = layers_[layer];
  const std::optional<size_t> from = IndexOf(kept, base), to = IndexOf(kept, target.version);
  if (!from || !to || *from > *to || kept[*to].held.entry != target.entry) return nullptr;
  std::vector<size_t> moved;
  for (size_t i = *from + 1; i <= *to; ++i) {
    if (kept[i].unchanged) continue;
    if (kept[i].changed == nullptr) return nullptr;  // a relay that keeps no version before
    moved.push_back(i);
  }
  if (moved.size() == 1) return kept[moved[0]].changed;  // the common delta
  // A value that changed and changed back is sent again: its newest bits,
  // so the delta still gives the target exactly (as the shards' own).
  const AssembledLayout& layout = layouts_[layer];
  auto changed = std::make_shared<ChangedElements>(layout.tensors().size());
  for (size_t t = 0; t < layout.tensors().size(); ++t) {
    const AssembledTensor& tensor = layout.tensors()[t];
    changed->elements[t].assign((tensor.num_elements + 63) / 64, 0);
    if (tensor.block_size != 0) {
      changed->scales[t].assign((Fp8BlockCount(tensor.num_elements, tensor.block_size) + 63) / 64,
                                0);
    }
  }
  for (const size_t i : moved) {
    const ChangedElements& since = *kept[i].changed;
    for (size_t t = 0; t < since.elements.size(); ++t) {
      Or(since.elements[t], changed->elements[t]);
      Or(since.scales[t], changed->scales[t]);
    }
  }
  return changed;
}

uint64_t RelayedVersions::Newest(uint32_t layer) const {
  absl::ReaderMutexLock lock(&mu_);
  return layers_[layer].empty() ? 0 : layers_[layer].back().held.version;
}

void RelayedVersions::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

bool RelayedVersions::closed() const {
  absl::ReaderMutexLock lock(&mu_);
  return closed_;
}

}  // namespace layercast::relay
