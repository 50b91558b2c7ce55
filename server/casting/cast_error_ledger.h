#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/cast_error.h"
#include "core/dtype.h"
#include "server/serving/shared_chunks.h"

namespace layercast::server {

// What each chunk's cast lost (core/cast_error.h), and the CRC-32C of its
// bytes, once per chunk and parameter version. The cast of a chunk at a
// version is the same bits every time, so a shard measures and checksums it
// the first time and looks both up after: a layer served to a thousand
// workers costs one measurement (a few times a cast's CPU, see
// bench/cast_bench.cc) and one CRC pass, the metrics count each element of a
// version once, and the policy's max_rel_error is checked against the same
// figure on every cast. A later cast sent with the first one's CRC still
// proves itself: a worker refuses bytes that differ from that first cast's.
// Float32 chunks (a copy of the master, nothing lost) are kept for their CRC
// only, and left out of the summaries.
//
// Keeps the newest version measured of each chunk of the shard's grid
// (GridChunks in server/serving/fetch_plan.h: the only chunks streams record), at
// most the whole grid, which the memory plan counts (BytesFor): it never
// forgets a chunk, so no chunk is measured or counted twice at one version,
// however large the model. Each layer's summary is kept up to date as its
// chunks are recorded, so GetCastError holds the lock, which casts wait on,
// for the layers, not for the grid's million chunks.
//
// Thread-safe.
class CastErrorLedger {
 public:
  // Keeps up to `grid_chunks` chunks of layers [0, layers); allocates the
  // chunks' table as they come, the layers' summaries at once.
  CastErrorLedger(uint64_t grid_chunks, uint32_t layers);

  // The most a ledger of `grid_chunks` chunks of `layers` layers holds,
  // growing to its last chunk included. Saturates at UINT64_MAX.
  static uint64_t BytesFor(uint64_t grid_chunks, uint32_t layers);

  struct Known {
    CastError error;
    // Of the whole chunk's bytes (a delta's packing has its own), once a
    // whole chunk was cast at this version.
    std::optional<uint32_t> crc32c;
  };
  // What the cast of `key` at key.version lost, if measured already.
  std::optional<Known> Find(const ChunkKey& key) const;
  // Keeps `error` as what the cast of `key` at key.version lost, and
  // `crc32c` (when given) as its bytes' CRC if none is kept yet. False when
  // the error was known already (another stream measured the same chunk at
  // the same time) or a newer version of the chunk is kept: the caller then
  // leaves it out of the metrics. False, keeping nothing, for a chunk
  // beyond the grid_chunks the ledger was made for, or of a layer beyond
  // its layers (which no stream on the grid reaches): a ledger never grows
  // past what the plan counted.
  bool Record(const ChunkKey& key, const CastError& error,
              std::optional<uint32_t> crc32c = std::nullopt);
  // Keeps `crc32c` as the bytes' CRC of `key` at key.version in place of
  // the one kept, if the chunk is kept at that version. True when a
  // different CRC was kept (it could only have come from a fault: the cast
  // of a chunk at a version is the same bits every time).
  bool ReplaceCrc(const ChunkKey& key, uint32_t crc32c);

  // One layer's figures for one dtype: its chunks measured at the newest
  // version any of them was measured at, summed.
  struct LayerSummary {
    uint32_t layer = 0;
    DType dtype = DType::kFloat32;
    uint64_t version = 0;
    uint64_t chunks = 0;
    CastError error;
  };
  // By layer, then dtype.
  std::vector<LayerSummary> Summarize() const;

 private:
  // A chunk at any version: ChunkKey without version and base_version (a
  // delta's values are those of its version).
  struct Slot {
    uint32_t layer = 0;
    uint32_t tensor = 0;
    uint64_t element_begin = 0;
    uint64_t elements = 0;
    DType dtype = DType::kFloat32;

    friend bool operator==(const Slot&, const Slot&) = default;
    template <typename H>
    friend H AbslHashValue(H h, const Slot& slot) {
      return H::combine(std::move(h), slot.layer, slot.tensor, slot.element_begin, slot.elements,
                        slot.dtype);
    }
  };
  struct Measured {
    uint64_t version = 0;
    Known known;
  };
  static Slot SlotOf(const ChunkKey& key);
  // Records nothing; logs the first time only.
  bool RefuseOffTheGrid(const ChunkKey& key, absl::string_view why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds a chunk newly kept at `version` to its layer's summary.
  void AddToSummary(const Slot& slot, uint64_t version, const CastError& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The dtypes a cast loses to (not float32), each with a summary a layer,
  // in DType's order, so Summarize lists a layer's dtypes in the order
  // GetCastErrorResponse promises.
  static constexpr std::array<DType, 4> kLossyDtypes = {DType::kBFloat16, DType::kFloat16,
                                                        DType::kFloat8E4M3FN, DType::kFloat8E5M2};
  // kLossyDtypes' index of `dtype`; kLossyDtypes.size() for one not in it
  // (float32), so a dtype added to DType but not here has no summary
  // rather than another's.
  static constexpr size_t LossyIndex(DType dtype) {
    for (size_t k = 0; k < kLossyDtypes.size(); ++k) {
      if (kLossyDtypes[k] == dtype) return k;
    }
    return kLossyDtypes.size();
  }

  const uint64_t grid_chunks_;
  const uint32_t layers_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<Slot, Measured> chunks_ ABSL_GUARDED_BY(mu_);
  // Layer l's summary for kLossyDtypes[k] at l * kLossyDtypes.size() + k.
  std::vector<LayerSummary> summaries_ ABSL_GUARDED_BY(mu_);
  bool warned_off_the_grid_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace layercast::server
