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

namespace layercast::relay {

// One layer at one version as a relay holds it: the assembled bytes its
// mirror pulled (the shards' casts, never cast again), shared by every
// stream that sends them and by the versions that left them equal.
struct HeldLayer {
  uint64_t version = 0;
  std::shared_ptr<const std::vector<uint8_t>> bytes;
  // Per shard, the incarnation of the shard that cast them: a relay names
  // it on its streams, so a delta from its versions goes on from the
  // shards.
  std::vector<uint64_t> incarnations;
};

// What a relay serves: every layer's newest version and up to `keep` of
// the versions before it (for deltas from them and pinned reads of them),
// and the version the relay's mirror is walking to. A layer is served as
// soon as it lands, so a relay's children walk right behind it rather than
// an update behind. Memory: each layer's bytes once per kept version whose
// values differ, at most keep + 1 copies of the model, plus those streams
// still send.
//
// Thread-safe.
class RelayedVersions {
 public:
  RelayedVersions(uint32_t layers, uint32_t keep);

  // The mirror walks to `version` (Create, or an update).
  void Heading(uint64_t version);
  // Layer `layer` landed at `version`: `bytes` are copied when `changed`,
  // else the values are those of its newest version.
  // REQUIRES: layer < layers; the first Put of a layer is `changed`.
  void Put(uint32_t layer, uint64_t version, bool changed, std::span<const uint8_t> bytes,
           std::vector<uint64_t> incarnations);

  // The version the relay serves or walks to, once it is at least
  // `min_version` or at `deadline` (then below it).
  uint64_t WaitHeading(uint64_t min_version, absl::Time deadline) const;
  // The lowest layer's newest version: what every layer holds.
  uint64_t held() const;

  // Layer `layer`'s newest version once it is at least `min_version`;
  // nullopt at `deadline` (or before the layer's first Put).
  std::optional<HeldLayer> WaitNewest(uint32_t layer, uint64_t min_version,
                                      absl::Time deadline) const;
  // Layer `layer`'s values at exactly `version`: a kept version of that
  // number, or one before it whose values the next kept version still
  // holds (nothing changed between them). nullopt when neither is kept.
  std::optional<HeldLayer> At(uint32_t layer, uint64_t version) const;
  // The layer's newest version, for messages; 0 before its first Put.
  uint64_t Newest(uint32_t layer) const;

  // Ends every wait now and every later one at once: the relay stops.
  void Close();
  bool closed() const;

 private:
  const uint32_t keep_;
  mutable absl::Mutex mu_;
  uint64_t heading_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // Per layer, oldest first.
  std::vector<std::deque<HeldLayer>> layers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::relay
