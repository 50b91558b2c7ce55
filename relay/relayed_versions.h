#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/layout.h"
#include "server/serving/memory_budget.h"

namespace layercast::relay {

// One layer at one version as a relay holds it: the assembled bytes its
// mirror pulled (the shards' casts, never cast again), shared by every
// stream that sends them and by the versions that left them equal.
struct HeldLayer {
  uint64_t version = 0;
  // Null where only the version's identity was asked for (Identity).
  std::shared_ptr<const std::vector<uint8_t>> bytes;
  // Per shard, the incarnation of the shard that cast them: a relay names
  // it on its streams, so a delta from its versions goes on from the
  // shards.
  std::vector<uint64_t> incarnations;
  // Which entry of the relay's it came from: a version pulled again (a torn
  // pull repaired) is another entry under the same number.
  uint64_t entry = 0;
};

// Per tensor, one bit per element (bit i % 64 of word i / 64): the elements
// whose bits differ between two versions of a layer; for an 8-bit float
// tensor, its codes, and in `scales` one bit per block scale (empty for
// other tensors).
struct ChangedElements {
  explicit ChangedElements(size_t tensors) : elements(tensors), scales(tensors) {}
  std::vector<std::vector<uint64_t>> elements, scales;
};

// What a relay serves: every layer's newest version and up to `keep` of
// the versions before it (for deltas from them and pinned reads of them),
// and the version the relay's mirror is walking to. A layer is served as
// soon as it lands, so a relay's children walk right behind it rather than
// an update behind.
//
// Memory: one copy of each layer, its newest version, written in place
// when no stream sends it (else into a new buffer: the old one lives until
// its last stream ends). Each kept version before it is an undo log, the
// elements the next version changed and their values before, plus a bit
// per element, so a publish that moves 1% of a bf16 layer costs about
// 1% + 1/16 of it per kept version, not a copy. An older version's bytes are rebuilt only for a
// stream that reads them whole (a pinned read), shared while any stream sends them; a delta needs
// only the changed elements, which the logs are.
//
// Thread-safe.
class RelayedVersions {
 public:
  // `layouts`: the layers as held (must outlive this).
  RelayedVersions(const std::vector<AssembledLayout>& layouts, uint32_t keep);

  // Counts every buffer of held bytes in `budget` (which must outlive
  // them) from its allocation until the last stream sending it lets go.
  void SetBudget(server::MemoryBudget* budget) { budget_ = budget; }

  // The mirror walks to `version` (Create, or an update).
  void Heading(uint64_t version);
  // Layer `layer` landed at `version`: `bytes` are copied when `changed`,
  // else the values are those of its newest version. Cast by other
  // incarnations than its newest (a shard restarted), it replaces every
  // version kept of the layer: their numbers may name other bits now; and
  // the heading follows it down when the numbers started again.
  // REQUIRES: layer < layers; the first Put of a layer is `changed`.
  void Put(uint32_t layer, uint64_t version, bool changed, std::span<const uint8_t> bytes,
           std::vector<uint64_t> incarnations);

  // The version the relay serves or walks to, once it is at least
  // `min_version` or at `deadline` (then below it); at once when
  // `incarnation` is set and shard `shard`'s incarnation of the newest
  // version held is another (the shards restarted: their numbers started
  // again).
  uint64_t WaitHeading(uint64_t min_version, absl::Time deadline, uint32_t shard = 0,
                       std::optional<uint64_t> incarnation = std::nullopt) const;
  // The incarnation of shard `shard` the newest pull of any layer came
  // from (WaitVersionResponse.incarnation); 0 before the first Put.
  uint64_t IncarnationOf(uint32_t shard) const;
  // The version the relay serves or walks to, now.
  uint64_t heading() const;
  // The lowest layer's newest version: what every layer holds.
  uint64_t held() const;

  // Layer `layer`'s newest version once it is at least `min_version` and
  // cast by the incarnations of the newest Put of any layer; nullopt at
  // `deadline` (or before the layer's first Put).
  std::optional<HeldLayer> WaitNewest(uint32_t layer, uint64_t min_version,
                                      absl::Time deadline) const;
  // Layer `layer`'s values at exactly `version`, if kept (and cast by the
  // incarnations of the newest Put: see WaitNewest). A version the
  // relay never pulled is not inferred from its neighbours even when
  // their values are equal: from another relay, equal bits do not prove
  // that nothing changed and changed back in between. An older version's
  // bytes are rebuilt from the newest and the undo logs (a copy of the
  // layer, counted in the budget) unless a stream already holds them.
  std::optional<HeldLayer> At(uint32_t layer, uint64_t version) const;
  // As At, without the bytes: which version, cast by whom. No copy.
  std::optional<HeldLayer> Identity(uint32_t layer, uint64_t version) const;
  // The elements of `layer` that changed from `base` to `version`, both as
  // At finds them: each kept version's changes from the one before it,
  // found as it landed; the one a single version's delta needs is shared,
  // not copied. Null when either is not kept. `target` is the version as
  // At or WaitNewest gave it: null as well if that entry has been replaced
  // since.
  std::shared_ptr<const ChangedElements> ChangedBetween(uint32_t layer, uint64_t base,
                                                        const HeldLayer& target) const;
  // The layer's newest version, for messages; 0 before its first Put.
  uint64_t Newest(uint32_t layer) const;

  // Ends every wait now and every later one at once: the relay stops.
  void Close();
  bool closed() const;

 private:
  struct Kept {
    // Its bytes only while it is the newest (the one live copy).
    HeldLayer held;
    // Its values are those of the version before it in the deque.
    bool unchanged = false;
    // Unless unchanged or the oldest kept: its changes from the version
    // before it, and that version's values at them (the undo log, in
    // tensor order, each tensor's elements and then its block scales).
    std::shared_ptr<const ChangedElements> changed;
    std::shared_ptr<const std::vector<uint8_t>> undo;
    // An older version's bytes rebuilt for a stream, shared while held
    // (a cache: set by the const At, under the lock held exclusively).
    mutable std::weak_ptr<const std::vector<uint8_t>> rebuilt;
  };
  uint64_t IncarnationOfLocked(uint32_t shard) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The index of the kept version At(version) finds; nullopt if none.
  std::optional<size_t> IndexOf(const std::deque<Kept>& kept, uint64_t version) const;
  // The bytes of `layer`'s kept entry `entry`: the newest's (also when
  // nothing changed since), or rebuilt from them; null if it is gone.
  std::shared_ptr<const std::vector<uint8_t>> BytesOf(uint32_t layer, uint64_t entry) const;
  // The version before the newest's bytes, rebuilt (for a repaired pull's
  // changes). Only the writer (Put's thread) calls it.
  std::shared_ptr<const std::vector<uint8_t>> BeforeNewest(uint32_t layer) const;

  // A buffer for a layer's bytes, counted in budget_.
  std::shared_ptr<std::vector<uint8_t>> Allocate(size_t bytes) const;
  // `changed`, counted in budget_ while kept.
  std::shared_ptr<const ChangedElements> Count(ChangedElements changed) const;

  const std::vector<AssembledLayout>& layouts_;
  const uint32_t keep_;
  server::MemoryBudget* budget_ = nullptr;
  mutable absl::Mutex mu_;
  uint64_t heading_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // Per layer, oldest first.
  std::vector<std::deque<Kept>> layers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_entry_ ABSL_GUARDED_BY(mu_) = 1;
  // The incarnations of the newest Put: versions of other ones are not
  // served (At, WaitNewest) until their layer lands again.
  std::vector<uint64_t> current_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::relay
