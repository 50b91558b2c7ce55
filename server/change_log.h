#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/model.h"
#include "server/parameter_store.h"
#include "server/server_metrics.h"

namespace layercast::server {

// The dtype of a layer's bits as ChangeLog compares them and PinnedVersions
// keeps them: the compute dtype, but float32 for the 8-bit floats, whose
// codes depend on their whole block's scale and are quantized again from
// the kept values.
inline DType KeptDType(DType compute) { return IsFloat8(compute) ? DType::kFloat32 : compute; }

// Which compute-dtype values of this shard's slice changed, for each of the
// last K versions of every layer: what a delta pull (FetchLayer with
// base_version) sends instead of the whole slice. One bit per owned element
// per version, set when the element's bits in its compute dtype (bfloat16,
// float16, or float32 for a float32 override; KeptDType) differ between version v-1
// and v. An element that changed and changed back is still marked: a delta
// may send a value the worker has already, never miss one.
//
// Recording is in two halves around whatever changes a layer's master (an
// optimizer step, a publish): Snapshot before, Record after, both while the
// caller holds the layer's ParameterStore::layer_mutex exclusively, before
// the layer's version advances in the VersionGate; a reader that holds the
// mutex shared and sees version V finds V's record here.
//
// Memory: K bitmaps of every layer, charged by the caller as
// BytesFor(...) when the shard starts (it is part of the memory plan).
//
// Thread-safe (a mutex per layer).
class ChangeLog {
 public:
  // Bytes `versions` records of every layer of shard `shard_index` take.
  static uint64_t BytesFor(const ModelSpec& model, uint32_t shard_index, uint32_t num_shards,
                           uint32_t versions);

  // Keeps the last `versions` (K >= 1) records of each layer of `store`,
  // which must outlive it. Nothing is recorded yet: a delta from a version
  // before the first record is not covered (after a restart, the first
  // delta after it falls back to a full pull).
  ChangeLog(const ParameterStore& store, uint32_t versions, ServerMetrics* metrics = nullptr);

  uint32_t versions() const { return versions_; }

  // A layer's compute-dtype bits before a change.
  class Snapshot {
   public:
    Snapshot() = default;
    // False when a cast failed: everything counts as changed, and there are
    // no bits to keep.
    bool whole() const { return whole_; }
    // Every owned element's compute-dtype bits, tensor by tensor (what
    // PinnedVersions keeps of the version the change ends).
    std::vector<uint8_t> TakeBits() && { return std::move(bits_); }

   private:
    friend class ChangeLog;
    std::vector<uint8_t> bits_;
    bool whole_ = true;
  };
  // REQUIRES: the layer's mutex held (exclusively, about to change it).
  // Throws std::bad_alloc when the snapshot cannot be allocated.
  Snapshot Take(uint32_t layer) const;

  // Records the change from `before` to the master now as version
  // `version` of `layer` (one more than the last recorded, or the first
  // record), dropping the oldest beyond K. Returns the elements that changed.
  // REQUIRES: the layer's mutex held exclusively.
  uint64_t Record(uint32_t layer, uint64_t version, const Snapshot& before);
  // Records a change of version that changed no value (a publish that left
  // the layer as it was).
  void RecordUnchanged(uint32_t layer, uint64_t version);

  // Whether the changes of `layer` from `base` to `current` (its version
  // now, or an older one a pinned reader asks for) are all held: base ==
  // current, or every version in (base, current] is recorded.
  bool Covers(uint32_t layer, uint64_t base, uint64_t current) const;
  // Whether Covers(layer, base, current) and no version in (base, current]
  // changed a value: the master now holds `base`'s values too.
  bool ChangedNothing(uint32_t layer, uint64_t base, uint64_t current) const;
  // The oldest base a delta to `current` can start from, for messages.
  uint64_t OldestBase(uint32_t layer, uint64_t current) const;

  // Sets bit i of `bits` (LSB first, 64 per word; `bits` is resized and
  // cleared) when element element_begin + i of `tensor` changed in any
  // version in (base, current]. REQUIRES: Covers(layer, base, current), and
  // the elements are owned by this shard.
  void ChangedSince(uint32_t layer, uint64_t base, uint64_t current, uint32_t tensor,
                    uint64_t element_begin, uint64_t elements, std::vector<uint64_t>& bits) const;

 private:
  struct Entry {
    uint64_t version = 0;
    std::vector<uint64_t> bits;  // empty: nothing changed
  };
  struct LayerLog {
    mutable absl::Mutex mu;
    std::vector<uint64_t> tensor_first;  // bit index of each tensor's first owned element
    uint64_t owned = 0;
    std::deque<Entry> entries ABSL_GUARDED_BY(mu);  // oldest first, consecutive versions
  };
  void Push(LayerLog& log, Entry entry);

  const ParameterStore& store_;
  const uint32_t versions_;
  ServerMetrics* const metrics_;  // null in unit tests
  std::vector<std::unique_ptr<LayerLog>> layers_;
};

}  // namespace layercast::server
