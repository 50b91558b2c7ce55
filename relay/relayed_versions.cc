#include "relay/relayed_versions.h"

#include <algorithm>
#include <utility>

namespace layercast::relay {

RelayedVersions::RelayedVersions(uint32_t layers, uint32_t keep) : keep_(keep), layers_(layers) {}

void RelayedVersions::Heading(uint64_t version) {
  absl::MutexLock lock(&mu_);
  heading_ = std::max(heading_, version);
}

void RelayedVersions::Put(uint32_t layer, uint64_t version, bool changed,
                          std::span<const uint8_t> bytes, std::vector<uint64_t> incarnations) {
  // The copy is made before the lock: readers wait for no memcpy.
  std::shared_ptr<const std::vector<uint8_t>> copy;
  if (changed) copy = std::make_shared<const std::vector<uint8_t>>(bytes.begin(), bytes.end());
  absl::MutexLock lock(&mu_);
  std::deque<HeldLayer>& held = layers_[layer];
  if (!changed && !held.empty()) copy = held.back().bytes;
  if (!held.empty() && held.back().version >= version) held.pop_back();  // pulled again
  held.push_back({version, std::move(copy), std::move(incarnations)});
  while (held.size() > keep_ + 1) held.pop_front();
  heading_ = std::max(heading_, version);
}

uint64_t RelayedVersions::WaitHeading(uint64_t min_version, absl::Time deadline) const {
  const auto reached = [this, min_version]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return heading_ >= min_version || closed_;
  };
  absl::ReaderMutexLock lock(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(&reached), deadline);
  return heading_;
}

uint64_t RelayedVersions::held() const {
  absl::ReaderMutexLock lock(&mu_);
  uint64_t lowest = UINT64_MAX;
  for (const std::deque<HeldLayer>& held : layers_) {
    lowest = std::min(lowest, held.empty() ? 0 : held.back().version);
  }
  return layers_.empty() ? 0 : lowest;
}

std::optional<HeldLayer> RelayedVersions::WaitNewest(uint32_t layer, uint64_t min_version,
                                                     absl::Time deadline) const {
  const auto reached = [this, layer, min_version]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return closed_ || (!layers_[layer].empty() && layers_[layer].back().version >= min_version);
  };
  absl::ReaderMutexLock lock(&mu_);
  if (!mu_.AwaitWithDeadline(absl::Condition(&reached), deadline) || closed_) {
    return std::nullopt;
  }
  return layers_[layer].back();
}

std::optional<HeldLayer> RelayedVersions::At(uint32_t layer, uint64_t version) const {
  absl::ReaderMutexLock lock(&mu_);
  const std::deque<HeldLayer>& held = layers_[layer];
  for (size_t i = 0; i < held.size(); ++i) {
    if (held[i].version == version) return held[i];
    if (held[i].version < version && i + 1 < held.size() && version < held[i + 1].version &&
        held[i].bytes == held[i + 1].bytes) {
      HeldLayer at = held[i + 1];
      at.version = version;
      return at;
    }
  }
  return std::nullopt;
}

uint64_t RelayedVersions::Newest(uint32_t layer) const {
  absl::ReaderMutexLock lock(&mu_);
  return layers_[layer].empty() ? 0 : layers_[layer].back().version;
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
