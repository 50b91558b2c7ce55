#include "relay/relayed_versions.h"

#include <algorithm>
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

}  // namespace

RelayedVersions::RelayedVersions(const std::vector<AssembledLayout>& layouts, uint32_t keep)
    : layouts_(layouts), keep_(keep), layers_(layouts.size()), spare_(layouts.size()) {}

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

void RelayedVersions::Heading(uint64_t version) {
  absl::MutexLock lock(&mu_);
  heading_ = std::max(heading_, version);
}

void RelayedVersions::Put(uint32_t layer, uint64_t version, bool changed,
                          std::span<const uint8_t> bytes, std::vector<uint64_t> incarnations) {
  // Only this thread (the mirror's) writes: what the newest holds is read
  // outside the lock, and the copy is made before taking it, so readers
  // wait for no memcpy.
  std::shared_ptr<const std::vector<uint8_t>> previous;
  std::shared_ptr<std::vector<uint8_t>> spare;
  {
    absl::MutexLock lock(&mu_);
    if (!layers_[layer].empty()) previous = layers_[layer].back().held.bytes;
    spare = std::move(spare_[layer]);
  }
  Kept kept{{version, previous, std::move(incarnations)}, true, nullptr};
  if (changed || previous == nullptr) {
    // Into the buffer of a version evicted earlier when there is one: a new
    // one costs the kernel a page fault and a zeroed page per 4 KiB, more
    // than the copy itself (measured: half a relay's CPU).
    if (spare == nullptr || spare->size() != bytes.size()) {
      spare = Allocate(bytes.size());
    }
    std::memcpy(spare->data(), bytes.data(), bytes.size());
    kept.held.bytes = std::move(spare);
    kept.unchanged = false;
  }
  absl::MutexLock lock(&mu_);
  std::deque<Kept>& held = layers_[layer];
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
  if (!held.empty() &&
      wire::OtherIncarnations(held.back().held.incarnations, kept.held.incarnations)) {
    // A version is an identity only with the incarnations that cast it:
    // what the restarted shards serve under an old number is other bits.
    const uint64_t newest = held.back().held.version;
    held.clear();
    kept.unchanged = false;
    if (version < newest) heading_ = std::min(heading_, version);
  }
  if (!held.empty() && held.back().held.version >= version) {
    // Pulled again (a torn pull repaired): it replaces the entry, and its
    // changes are from the one before that.
    held.pop_back();
    kept.unchanged = !held.empty() && kept.held.bytes == held.back().held.bytes;
  }
  held.push_back(std::move(kept));
  while (held.size() > keep_ + 1) {
    // Its buffer is reused when nothing else holds it: no stream sends it
    // (they hold their own reference, taken under this lock) and no newer
    // version shares it.
    std::shared_ptr<const std::vector<uint8_t>> evicted = std::move(held.front().held.bytes);
    held.pop_front();
    if (evicted.use_count() == 1) {
      spare_[layer] = std::const_pointer_cast<std::vector<uint8_t>>(std::move(evicted));
    }
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

std::optional<HeldLayer> RelayedVersions::At(uint32_t layer, uint64_t version) const {
  absl::ReaderMutexLock lock(&mu_);
  const std::optional<size_t> i = IndexOf(layers_[layer], version);
  if (!i || wire::OtherIncarnations(layers_[layer][*i].held.incarnations, current_))
    return std::nullopt;
  HeldLayer at = layers_[layer][*i].held;
  at.version = version;
  return at;
}

std::shared_ptr<const ChangedElements> RelayedVersions::ChangedBetween(
    uint32_t layer, uint64_t base, const HeldLayer& target) const {
  const uint64_t version = target.version;
  // The versions whose changes no delta has asked for yet: compared outside
  // the lock (a layer takes milliseconds), then kept.
  struct Missing {
    uint64_t version;
    std::shared_ptr<const std::vector<uint8_t>> now, was;
  };
  std::vector<Missing> missing;
  {
    absl::ReaderMutexLock lock(&mu_);
    const std::deque<Kept>& kept = layers_[layer];
    const std::optional<size_t> from = IndexOf(kept, base), to = IndexOf(kept, version);
    if (!from || !to || *from > *to) return nullptr;
    for (size_t i = *from + 1; i <= *to; ++i) {
      if (!kept[i].unchanged && kept[i].changed == nullptr) {
        missing.push_back({kept[i].held.version, kept[i].held.bytes, kept[i - 1].held.bytes});
      }
    }
  }
  std::vector<std::shared_ptr<const ChangedElements>> found;
  for (const Missing& m : missing) {
    found.push_back(std::make_shared<const ChangedElements>(
        Changes(layouts_[layer], m.now->data(), m.was->data())));
  }
  absl::MutexLock lock(&mu_);
  const std::deque<Kept>& kept = layers_[layer];
  for (size_t m = 0; m < missing.size(); ++m) {
    for (size_t i = 1; i < kept.size(); ++i) {
      // The same two versions still (not replaced by a repair meanwhile).
      if (kept[i].held.version == missing[m].version && kept[i].held.bytes == missing[m].now &&
          kept[i - 1].held.bytes == missing[m].was) {
        kept[i].changed = found[m];
      }
    }
  }
  const std::optional<size_t> from = IndexOf(kept, base), to = IndexOf(kept, version);
  if (!from || !to || *from > *to || kept[*to].held.bytes != target.bytes) return nullptr;
  std::vector<size_t> moved;
  for (size_t i = *from + 1; i <= *to; ++i) {
    if (kept[i].unchanged) continue;
    if (kept[i].changed == nullptr) return nullptr;  // replaced meanwhile: rare
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
