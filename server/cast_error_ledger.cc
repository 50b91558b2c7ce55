#include "server/cast_error_ledger.h"

#include <algorithm>
#include <bit>
#include <map>
#include <tuple>
#include <utility>

#include "core/log.h"

namespace layercast::server {

CastErrorLedger::CastErrorLedger(uint64_t grid_chunks) : grid_chunks_(grid_chunks) {}

uint64_t CastErrorLedger::BytesFor(uint64_t grid_chunks) {
  // Far past any memory; below it nothing here overflows.
  if (grid_chunks > (uint64_t{1} << 40)) return UINT64_MAX;
  // absl grows a table at 7/8 full to a power of two of slots (less one),
  // each with a control byte, and a group's worth of control bytes more;
  // while it grows, the old table (half the slots) is still held.
  constexpr uint64_t kGroup = 16;
  const uint64_t slots = std::bit_ceil(grid_chunks + grid_chunks / 7 + 1);
  const uint64_t table = slots * (sizeof(std::pair<const Slot, Measured>) + 1) + kGroup;
  return table + table / 2;
}

CastErrorLedger::Slot CastErrorLedger::SlotOf(const ChunkKey& key) {
  return {.layer = key.layer,
          .tensor = key.tensor,
          .element_begin = key.element_begin,
          .elements = key.elements,
          .dtype = key.dtype};
}

std::optional<CastErrorLedger::Known> CastErrorLedger::Find(const ChunkKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = chunks_.find(SlotOf(key));
  if (it == chunks_.end() || it->second.version != key.version) return std::nullopt;
  return it->second.known;
}

bool CastErrorLedger::Record(const ChunkKey& key, const CastError& error,
                             std::optional<uint32_t> crc32c) {
  absl::MutexLock lock(&mu_);
  const Slot slot = SlotOf(key);
  auto it = chunks_.find(slot);
  if (it != chunks_.end()) {
    if (it->second.version == key.version && !it->second.known.crc32c.has_value()) {
      it->second.known.crc32c = crc32c;
    }
    if (it->second.version >= key.version) return false;
    it->second = {key.version, {error, crc32c}};
    return true;
  }
  if (chunks_.size() >= grid_chunks_) {
    // Only a chunk off the grid the ledger was made for gets here: a bug,
    // which would otherwise only show as a chunk measured on every cast.
    if (!warned_beyond_grid_) {
      warned_beyond_grid_ = true;
      Log()->error(
          "layer {} tensor {} elements [{}, {}): the cast-error ledger, made for {} chunks, is "
          "full; this chunk is measured on every cast and left out of the metrics (please report "
          "it with the shard's flags)",
          key.layer, key.tensor, key.element_begin, key.element_begin + key.elements, grid_chunks_);
    }
    return false;
  }
  chunks_.emplace(slot, Measured{key.version, {error, crc32c}});
  return true;
}

bool CastErrorLedger::ReplaceCrc(const ChunkKey& key, uint32_t crc32c) {
  absl::MutexLock lock(&mu_);
  auto it = chunks_.find(SlotOf(key));
  if (it == chunks_.end() || it->second.version != key.version) return false;
  std::optional<uint32_t>& kept = it->second.known.crc32c;
  const bool differed = kept.has_value() && *kept != crc32c;
  kept = crc32c;
  return differed;
}

std::vector<CastErrorLedger::LayerSummary> CastErrorLedger::Summarize() const {
  std::map<std::tuple<uint32_t, DType>, LayerSummary> layers;
  absl::MutexLock lock(&mu_);
  for (const auto& [slot, measured] : chunks_) {
    if (slot.dtype == DType::kFloat32) continue;  // kept for the CRC
    LayerSummary& summary = layers[{slot.layer, slot.dtype}];
    if (summary.chunks != 0 && measured.version < summary.version) continue;
    if (summary.chunks == 0 || measured.version > summary.version) {
      summary = LayerSummary();
      summary.layer = slot.layer;
      summary.dtype = slot.dtype;
      summary.version = measured.version;
    }
    ++summary.chunks;
    summary.error.Add(measured.known.error);
  }
  std::vector<LayerSummary> out;
  out.reserve(layers.size());
  for (auto& [key, summary] : layers) out.push_back(std::move(summary));
  return out;
}

}  // namespace layercast::server
