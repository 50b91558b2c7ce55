#include "server/serving/change_log.h"

#include <algorithm>
#include <new>

#include "core/cast.h"
#include "core/changed_bits.h"
#include "core/layout.h"
#include "platform/log.h"

namespace layercast::server {
namespace {

constexpr uint64_t Words(uint64_t bits) { return (bits + 63) / 64; }

// Compared a cache-sized block at a time: the new values are cast into it
// and compared with the snapshot while both are in cache.
constexpr uint64_t kBlockElements = TensorOptimizer::kObservedBlock;

// Marks `count` elements from bit `first` changed.
void MarkAll(uint64_t first, uint64_t count, std::vector<uint64_t>& bits) {
  for (uint64_t i = 0; i < count; ++i) bits[(first + i) / 64] |= uint64_t{1} << ((first + i) % 64);
}

// Scratch for one block's compute-dtype bits, per thread (steps of
// different layers run in parallel): 0 holds the bits before a change, 1
// the bits after.
uint8_t* BlockScratch(int which) {
  alignas(64) thread_local uint8_t scratch[2][kBlockElements * sizeof(float)];
  return scratch[which];
}

// Casts `count` (at most kBlockElements) values `now` to `dtype` and marks,
// from bit `first`, those whose bits differ from `old_bits`; returns how
// many. A value that cannot be cast (a float16 overflow under
// overflow=error) is marked changed: a pull of it fails anyway.
uint64_t MarkChangedBlock(const float* now, uint64_t count, const uint8_t* old_bits, DType dtype,
                          Fp16Overflow overflow, uint64_t first, std::vector<uint64_t>& bits) {
  uint8_t* const fresh = BlockScratch(1);
  if (!CastFromF32(now, fresh, count, dtype, overflow).ok()) {
    MarkAll(first, count, bits);
    return count;
  }
  return MarkChangedBitsFrom(fresh, old_bits, count, DTypeSize(dtype), first, bits);
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
  // The K records, and the one the next step fills: the record dropped
  // last, kept for it (LayerLog::spare), or a new one while K are held.
  return versions == 0 ? 0 : bytes * (versions + 1);
}

ChangeLog::ChangeLog(const ParameterStore& store, uint32_t versions, ServerMetrics* metrics,
                     std::chrono::steady_clock::duration idle, Now now)
    : store_(store),
      versions_(std::max<uint32_t>(1, versions)),
      metrics_(metrics),
      idle_(idle),
      now_(now),
      last_asked_(kNeverAsked),
      wanted_(idle == std::chrono::steady_clock::duration::zero()) {
  for (uint32_t l = 0; l < store.model().layers.size(); ++l) {
    auto log = std::make_unique<LayerLog>();
    for (uint32_t t = 0; t < store.model().layers[l].tensors.size(); ++t) {
      log->tensor_first.push_back(log->owned);
      log->owned += store.owned(l, t).size();
      log->kept_first.push_back(log->kept_bytes);
      log->kept_bytes += store.owned(l, t).size() *
                         DTypeSize(KeptDType(store.layout(l).tensors()[t].compute_dtype));
    }
    layers_.push_back(std::move(log));
  }
}

ChangeLog::Snapshot ChangeLog::Take(uint32_t layer) const {
  Snapshot snapshot;
  const AssembledLayout& layout = store_.layout(layer);
  snapshot.bits_.resize(layers_[layer]->kept_bytes);
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
  while (log.entries.size() > versions_) {
    if (log.entries.front().bits.capacity() > log.spare.capacity()) {
      log.spare = std::move(log.entries.front().bits);
    }
    log.entries.pop_front();
  }
}

std::vector<uint64_t> ChangeLog::TakeBitmap(LayerLog& log) {
  std::vector<uint64_t> bits;
  {
    absl::MutexLock lock(&log.mu);
    bits.swap(log.spare);
  }
  bits.assign(Words(log.owned), 0);  // no allocation when the spare fits
  return bits;
}

void ChangeLog::NoteAsked() const {
  last_asked_.store(now_().time_since_epoch().count(), std::memory_order_relaxed);
}

bool ChangeLog::Wanted() const {
  const std::chrono::steady_clock::rep asked = last_asked_.load(std::memory_order_relaxed);
  const bool wanted =
      idle_ == std::chrono::steady_clock::duration::zero() ||
      (asked != kNeverAsked &&
       now_() - std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(asked)) <
           idle_);
  if (wanted_.exchange(wanted, std::memory_order_relaxed) != wanted) {
    if (wanted) {
      Log()->info(
          "recording what each step changes again: a reader asked for a delta or a "
          "pinned version");
    } else {
      Log()->info(
          "no delta pull or pinned read for {} s: steps are no longer recorded until one "
          "comes (the first delta after is pulled in full)",
          std::chrono::duration_cast<std::chrono::seconds>(idle_).count());
    }
  }
  return wanted;
}

ChangeLog::Recording::Recording(ChangeLog& log, uint32_t layer, bool keep_before,
                                std::vector<uint8_t> reuse)
    : log_(log), layer_(layer), bits_(log.TakeBitmap(*log.layers_[layer])) {
  if (!keep_before) return;
  const uint64_t bytes = log.layers_[layer]->kept_bytes;
  // A reused buffer of the right size is taken as it is: every byte is
  // cast into before it is read.
  if (reuse.size() != bytes) reuse = std::vector<uint8_t>(bytes);
  before_.bits_ = std::move(reuse);
}

StepObserver* ChangeLog::Recording::ForTensor(uint32_t tensor) {
  before_offset_ = log_.layers_[layer_]->kept_first[tensor];
  tensor_ = tensor;
  dtype_ = KeptDType(log_.store_.layout(layer_).tensors()[tensor].compute_dtype);
  return this;
}

void ChangeLog::Recording::Before(size_t offset, std::span<const float> block) {
  uint8_t* out = before_.bits_.empty()
                     ? BlockScratch(0)
                     : before_.bits_.data() + before_offset_ + offset * DTypeSize(dtype_);
  block_cast_ =
      CastFromF32(block.data(), out, block.size(), dtype_, log_.store_.policy().overflow()).ok();
  // A version whose bits could not all be cast is not kept whole.
  if (!block_cast_) before_.whole_ = false;
}

void ChangeLog::Recording::After(size_t offset, std::span<const float> block) {
  const size_t size = DTypeSize(dtype_);
  const uint64_t first = log_.layers_[layer_]->tensor_first[tensor_] + offset;
  const uint8_t* old_bits = before_.bits_.empty()
                                ? BlockScratch(0)
                                : before_.bits_.data() + before_offset_ + offset * size;
  if (!block_cast_) {  // the bits before are unknown: marked changed
    MarkAll(first, block.size(), bits_);
    changed_ += block.size();
    return;
  }
  changed_ += MarkChangedBlock(block.data(), block.size(), old_bits, dtype_,
                               log_.store_.policy().overflow(), first, bits_);
}

uint64_t ChangeLog::Recording::Commit(uint64_t version) {
  LayerLog& log = *log_.layers_[layer_];
  Entry entry{version, std::move(bits_)};
  if (changed_ == 0) entry.bits.clear();
  log_.Push(log, std::move(entry));
  if (log_.metrics_ != nullptr) log_.metrics_->RecordVersionChange(changed_, log.owned);
  return changed_;
}

ChangeLog::Snapshot ChangeLog::Recording::TakeBefore() && {
  if (before_.bits_.empty()) before_.whole_ = false;
  return std::move(before_);
}

uint64_t ChangeLog::Record(uint32_t layer, uint64_t version, const Snapshot& before) {
  LayerLog& log = *layers_[layer];
  Entry entry{version, {}};
  try {
    entry.bits = TakeBitmap(log);
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
    for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
      const DType dtype = KeptDType(layout.tensors()[t].compute_dtype);
      const uint8_t* old_bits = before.bits_.data() + log.kept_first[t];
      const uint64_t owned = store_.owned(layer, t).size();
      const float* master = store_.master(layer, t);
      for (uint64_t done = 0; done < owned; done += kBlockElements) {
        const uint64_t count = std::min(kBlockElements, owned - done);
        changed +=
            MarkChangedBlock(master + done, count, old_bits + done * DTypeSize(dtype), dtype,
                             store_.policy().overflow(), log.tensor_first[t] + done, entry.bits);
      }
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

void ChangeLog::Forget(uint32_t layer) {
  LayerLog& log = *layers_[layer];
  absl::MutexLock lock(&log.mu);
  log.entries.clear();
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
