#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/model.h"
#include "core/optimizer.h"
#include "server/serving/parameter_store.h"
#include "server/serving/server_metrics.h"

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
// Recording is in two halves around whatever changes a layer's master (a
// publish): Snapshot before, Record after, both while the caller holds the
// layer's ParameterStore::layer_mutex exclusively, before the layer's
// version advances in the VersionGate; a reader that holds the mutex shared
// and sees version V finds V's record here. An optimizer step records in
// the same pass as its update instead (Recording, a StepObserver): each
// block is cast before and after while it is in cache, so recording costs
// two casts of the slice from cache and no pass over memory of its own.
//
// Only while someone reads what it keeps: a training shard records its
// steps from the first request for a delta or a pinned version (NoteAsked)
// until none has come for `idle` (Wanted()); the versions stepped while it
// does not are not covered (a delta from them is refused, and the worker
// pulls in full, which asks for the next).
//
// Memory: K + 1 bitmaps of every layer (the K records and the one the next
// change fills), charged by the caller as BytesFor(...) when the shard
// starts (it is part of the memory plan).
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
  // `idle`: how long after the last NoteAsked steps are still recorded
  // (none before the first); zero records every step. `now`: the
  // clock that measures it (a seam for tests).
  using Now = std::chrono::steady_clock::time_point (*)();
  ChangeLog(const ParameterStore& store, uint32_t versions, ServerMetrics* metrics = nullptr,
            std::chrono::steady_clock::duration idle = {},
            Now now = &std::chrono::steady_clock::now);

  uint32_t versions() const { return versions_; }

  // A reader asked for what the log keeps: a delta pull, a pinned read, a
  // stream a change overtook, or a pull whose caller will pull deltas
  // (FetchLayerRequest.will_pull_deltas). Cheap: one relaxed store.
  void NoteAsked() const;
  // Whether an optimizer step should be recorded now (see the class comment).
  bool Wanted() const;

  class Recording;
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
    friend class Recording;
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
  // Forgets every record of `layer`: its values jumped over versions this
  // shard never held (a shard brought level by a publish), so no delta may
  // start from a version before the jump.
  void Forget(uint32_t layer);

  // One optimizer step of one layer, recorded as it updates: observe each
  // tensor's Step with ForTensor(t), then Commit. With `keep_before`, the
  // compute-dtype bits before the step are kept as they are cast (what
  // PinnedVersions keeps), into `reuse` (PinnedVersions::TakeSpare) when it
  // is the right size. REQUIRES: the layer's mutex held exclusively from
  // construction to Commit. Throws std::bad_alloc when its bitmap or
  // snapshot cannot be allocated.
  class Recording : public StepObserver {
   public:
    Recording(ChangeLog& log, uint32_t layer, bool keep_before, std::vector<uint8_t> reuse = {});
    StepObserver* ForTensor(uint32_t tensor);
    // Records the step as version `version` (as Record); returns the
    // elements that changed.
    uint64_t Commit(uint64_t version);
    // The bits before the step, once committed (whole() false unless
    // keep_before and every block was cast).
    Snapshot TakeBefore() &&;

    void Before(size_t offset, std::span<const float> block) override;
    void After(size_t offset, std::span<const float> block) override;

   private:
    ChangeLog& log_;
    const uint32_t layer_;
    std::vector<uint64_t> bits_;
    Snapshot before_;
    uint32_t tensor_ = 0;
    DType dtype_ = DType::kFloat32;
    uint64_t before_offset_ = 0;  // the tensor's first byte in before_
    bool block_cast_ = false;     // the current block's Before succeeded
    uint64_t changed_ = 0;
  };

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
    // Byte offset of each tensor's first element in a Snapshot (KeptDType
    // bits, tensor by tensor), and a Snapshot's size.
    std::vector<uint64_t> kept_first;
    uint64_t kept_bytes = 0;
    std::deque<Entry> entries ABSL_GUARDED_BY(mu);  // oldest first, consecutive versions
    // The bitmap of the last record dropped, reused by the next: a step
    // allocates nothing once the log is full.
    std::vector<uint64_t> spare ABSL_GUARDED_BY(mu);
  };
  void Push(LayerLog& log, Entry entry);
  // A cleared bitmap for one record of `log`: the last one dropped from it,
  // else a new one (throws std::bad_alloc).
  std::vector<uint64_t> TakeBitmap(LayerLog& log);

  const ParameterStore& store_;
  const uint32_t versions_;
  ServerMetrics* const metrics_;  // null in unit tests
  const std::chrono::steady_clock::duration idle_;
  const Now now_;
  static constexpr std::chrono::steady_clock::rep kNeverAsked =
      std::numeric_limits<std::chrono::steady_clock::rep>::min();
  mutable std::atomic<std::chrono::steady_clock::rep> last_asked_;
  mutable std::atomic<bool> wanted_;  // for logging each change of it once
  std::vector<std::unique_ptr<LayerLog>> layers_;
};

}  // namespace layercast::server
