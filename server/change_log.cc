#include "server/change_log.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "core/cast.h"
#include "core/layout.h"

namespace layercast::server {
namespace {

constexpr uint64_t Words(uint64_t bits) { return (bits + 63) / 64; }

// Compared a cache-sized block at a time: the new values are cast into it
// and compared with the snapshot while both are in cache.
constexpr uint64_t kBlockElements = 4096;

// Sets bit `first + i` of `bits` for each i where the elements of
// `element_size` bytes at `a` and `b` differ; returns how many.
uint64_t MarkDifferences(const uint8_t* a, const uint8_t* b, uint64_t count, size_t element_size,
                         uint64_t first, std::vector<uint64_t>& bits) {
  uint64_t changed = 0;
  for (uint64_t i = 0; i < count; ++i) {
    if (std::memcmp(a + i * element_size, b + i * element_size, element_size) != 0) {
      const uint64_t bit = first + i;
      bits[bit / 64] |= uint64_t{1} << (bit % 64);
      ++changed;
    }
  }
  return changed;
}

}  // namespace

uint64_t ChangeLog::BytesFor(const ModelSpec& model, uint32_t shard_index, uint32_t num_shards,
                             uint32_t versions) {
  uint64_t bytes = 0;
  for (const LayerSpec& layer : model.layers) {
    uint64_t owned = 0;
    for (const TensorSpec& tensor : layer.tensors) {
      owned += ShardElementRange(tensor.num_elements, shard_index, num_shards).size();
    }
    bytes += Words(owned) * sizeof(uint64_t);
  }
  return bytes * versions;
}

ChangeLog::ChangeLog(const ParameterStore& store, uint32_t versions, ServerMetrics* metrics)
    : store_(store), versions_(std::max<uint32_t>(1, versions)), metrics_(metrics) {
  for (uint32_t l = 0; l < store.model().layers.size(); ++l) {
    auto log = std::make_unique<LayerLog>();
    for (uint32_t t = 0; t < store.model().layers[l].tensors.size(); ++t) {
      log->tensor_first.push_back(log->owned);
      log->owned += store.owned(l, t).size();
    }
    layers_.push_back(std::move(log));
  }
}

ChangeLog::Snapshot ChangeLog::Take(uint32_t layer) const {
  Snapshot snapshot;
  const AssembledLayout& layout = store_.layout(layer);
  uint64_t bytes = 0;
  for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
    bytes +=
        store_.owned(layer, t).size() * DTypeSize(KeptDType(layout.tensors()[t].compute_dtype));
  }
  snapshot.bits_.resize(bytes);
  uint8_t* out = snapshot.bits_.data();
  for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
    const DType dtype = KeptDType(layout.tensors()[t].compute_dtype);
    const uint64_t owned = store_.owned(layer, t).size();
    if (owned == 0) continue;  // nothing to cast, and no master to cast from
    if (!CastFromF32(store_.master(layer, t), out, owned, dtype, store_.policy().overflow()).ok()) {
      snapshot.whole_ = false;
      return snapshot;
    }
    out += owned * DTypeSize(dtype);
  }
  return snapshot;
}

void ChangeLog::Push(LayerLog& log, Entry entry) {
  absl::MutexLock lock(&log.mu);
  // A record that does not follow the last one starts the log afresh: the
  // versions in between are not known.
  if (!log.entries.empty() && log.entries.back().version + 1 != entry.version) {
    log.entries.clear();
  }
  log.entries.push_back(std::move(entry));
  while (log.entries.size() > versions_) log.entries.pop_front();
}

uint64_t ChangeLog::Record(uint32_t layer, uint64_t version, const Snapshot& before) {
  LayerLog& log = *layers_[layer];
  Entry entry{version, {}};
  try {
    entry.bits.assign(Words(log.owned), 0);
  } catch (const std::bad_alloc&) {
    // Unrecorded, the log starts afresh at the next version: a delta from
    // before it is refused (the worker pulls in full), never wrong.
    absl::MutexLock lock(&log.mu);
    log.entries.clear();
    return log.owned;
  }
  const AssembledLayout& layout = store_.layout(layer);
  uint64_t changed = 0;
  if (!before.whole_) {
    std::fill(entry.bits.begin(), entry.bits.end(), ~uint64_t{0});
    changed = log.owned;
  } else {
    alignas(64) uint8_t block[kBlockElements * sizeof(float)];
    const uint8_t* old_bits = before.bits_.data();
    for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
      const DType dtype = KeptDType(layout.tensors()[t].compute_dtype);
      const size_t size = DTypeSize(dtype);
      const uint64_t owned = store_.owned(layer, t).size();
      const float* master = store_.master(layer, t);
      for (uint64_t done = 0; done < owned;) {
        const uint64_t count = std::min(kBlockElements, owned - done);
        const uint64_t first = log.tensor_first[t] + done;
        if (CastFromF32(master + done, block, count, dtype, store_.policy().overflow()).ok()) {
          changed += MarkDifferences(block, old_bits + done * size, count, size, first, entry.bits);
        } else {
          // The new value cannot be cast (a float16 overflow under
          // overflow=error): a pull of it fails anyway, so marked changed.
          for (uint64_t i = 0; i < count; ++i) {
            entry.bits[(first + i) / 64] |= uint64_t{1} << ((first + i) % 64);
          }
          changed += count;
        }
        done += count;
      }
      old_bits += owned * size;
    }
  }
  if (changed == 0) entry.bits.clear();
  Push(log, std::move(entry));
  if (metrics_ != nullptr) metrics_->RecordVersionChange(changed, log.owned);
  return changed;
}

void ChangeLog::RecordUnchanged(uint32_t layer, uint64_t version) {
  Push(*layers_[layer], Entry{version, {}});
}

bool ChangeLog::Covers(uint32_t layer, uint64_t base, uint64_t current) const {
  if (base == current) return true;
  if (base > current) return false;
  return OldestBase(layer, current) <= base;
}

uint64_t ChangeLog::OldestBase(uint32_t layer, uint64_t current) const {
  const LayerLog& log = *layers_[layer];
  absl::MutexLock lock(&log.mu);
  if (log.entries.empty() || current < log.entries.front().version ||
      current > log.entries.back().version) {
    return current;
  }
  return log.entries.front().version - 1;
}

bool ChangeLog::ChangedNothing(uint32_t layer, uint64_t base, uint64_t current) const {
  if (base == current) return true;
  if (base > current) return false;
  const LayerLog& log = *layers_[layer];
  // One look under the lock: a record pushed between two would make the
  // answer about two different logs.
  absl::MutexLock lock(&log.mu);
  if (log.entries.empty() || current < log.entries.front().version ||
      current > log.entries.back().version || base + 1 < log.entries.front().version) {
    return false;  // (base, current] not all recorded
  }
  return std::all_of(log.entries.begin(), log.entries.end(), [&](const Entry& entry) {
    return entry.version <= base || entry.version > current || entry.bits.empty();
  });
}

void ChangeLog::ChangedSince(uint32_t layer, uint64_t base, uint64_t current, uint32_t tensor,
                             uint64_t element_begin, uint64_t elements,
                             std::vector<uint64_t>& bits) const {
  const LayerLog& log = *layers_[layer];
  bits.assign(Words(elements), 0);
  const uint64_t first =
      log.tensor_first[tensor] + (element_begin - store_.owned(layer, tensor).begin);
  absl::MutexLock lock(&log.mu);
  for (const Entry& entry : log.entries) {
    if (entry.version <= base || entry.version > current || entry.bits.empty()) continue;
    const uint64_t shift = first % 64;
    const uint64_t* source = entry.bits.data() + first / 64;
    const uint64_t source_words = entry.bits.size() - first / 64;
    for (uint64_t w = 0; w < bits.size(); ++w) {
      uint64_t word = source[w] >> shift;
      if (shift != 0 && w + 1 < source_words) word |= source[w + 1] << (64 - shift);
      bits[w] |= word;
    }
  }
  // Bits past the span came from the next tensor's elements.
  if (const uint64_t tail = elements % 64; tail != 0) bits.back() &= (uint64_t{1} << tail) - 1;
}

}  // namespace layercast::server
