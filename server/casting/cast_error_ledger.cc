#include "server/casting/cast_error_ledger.h"

#include <algorithm>
#include <bit>
#include <functional>
#include <utility>

#include <unistd.h>

#include "platform/log.h"

namespace layercast::server {

CastErrorLedger::CastErrorLedger(uint64_t grid_chunks, uint32_t layers)
    : grid_chunks_(grid_chunks), layers_(layers) {
  static_assert(LossyIndex(DType::kFloat32) == kLossyDtypes.size());
  // Strictly increasing: a dtype listed twice would keep a summary never filled.
  static_assert(std::is_sorted(kLossyDtypes.begin(), kLossyDtypes.end(), std::less_equal<>()));
  summaries_.resize(size_t{layers} * kLossyDtypes.size());
  for (uint32_t layer = 0; layer < layers; ++layer) {
    for (size_t k = 0; k < kLossyDtypes.size(); ++k) {
      LayerSummary& summary = summaries_[layer * kLossyDtypes.size() + k];
      summary.layer = layer;
      summary.dtype = kLossyDtypes[k];
    }
  }
}

uint64_t CastErrorLedger::BytesFor(uint64_t grid_chunks, uint32_t layers) {
  // Far past any memory; below it nothing here overflows.
  if (grid_chunks > (uint64_t{1} << 40)) return UINT64_MAX;
  // The summaries are one block, which malloc maps on its own when large:
  // whole pages, a 16-byte header first.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t summaries =
      (uint64_t{layers} * kLossyDtypes.size() * sizeof(LayerSummary) + 16 + page - 1) / page * page;
  // absl grows a table at 7/8 full to a power of two of slots (less one),
  // each with a control byte, and a group's worth of control bytes more;
  // while it grows, the old table (half the slots) is still held.
  constexpr uint64_t kGroup = 16;
  const uint64_t slots = std::bit_ceil(grid_chunks + grid_chunks / 7 + 1);
  const uint64_t table = slots * (sizeof(std::pair<const Slot, Measured>) + 1) + kGroup;
  return table + table / 2 + summaries;
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
  if (key.layer >= layers_) return RefuseOffTheGrid(key, "of a layer beyond the model's");
  const Slot slot = SlotOf(key);
  auto it = chunks_.find(slot);
  if (it != chunks_.end()) {
    if (it->second.version == key.version && !it->second.known.crc32c.has_value()) {
      it->second.known.crc32c = crc32c;
    }
    if (it->second.version >= key.version) return false;
    it->second = {key.version, {error, crc32c}};
  } else {
    if (chunks_.size() >= grid_chunks_) return RefuseOffTheGrid(key, "beyond the grid's chunks");
    chunks_.emplace(slot, Measured{key.version, {error, crc32c}});
  }
  AddToSummary(slot, key.version, error);
  return true;
}

bool CastErrorLedger::RefuseOffTheGrid(const ChunkKey& key, absl::string_view why) {
  // Only a chunk off the grid the ledger was made for gets here: a bug,
  // which would otherwise only show as a chunk measured on every cast.
  if (!warned_off_the_grid_) {
    warned_off_the_grid_ = true;
    Log()->error(
        "layer {} tensor {} elements [{}, {}): a chunk {} in the cast-error ledger, made for {} "
        "chunks of {} layers; this chunk is measured on every cast and left out of the metrics "
        "(please report it with the shard's flags)",
        key.layer, key.tensor, key.element_begin, key.element_begin + key.elements, why,
        grid_chunks_, layers_);
  }
  return false;
}

void CastErrorLedger::AddToSummary(const Slot& slot, uint64_t version, const CastError& error) {
  const size_t k = LossyIndex(slot.dtype);
  // Float32 (kept for its CRC only) or a dtype with no summary.
  if (k == kLossyDtypes.size()) return;
  // A chunk's entry only ever moves to a newer version, so the chunks at a
  // layer's newest version stay there until one moves past it.
  LayerSummary& summary = summaries_[slot.layer * kLossyDtypes.size() + k];
  if (summary.chunks != 0 && version < summary.version) return;
  if (summary.chunks == 0 || version > summary.version) {
    summary.version = version;
    summary.chunks = 0;
    summary.error = CastError();
  }
  ++summary.chunks;
  summary.error.Add(error);
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
  std::vector<LayerSummary> out;
  absl::MutexLock lock(&mu_);
  for (const LayerSummary& summary : summaries_) {
    if (summary.chunks != 0) out.push_back(summary);
  }
  return out;
}

}  // namespace layercast::server
