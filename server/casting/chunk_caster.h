#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "core/cast_error.h"
#include "server/casting/cast_error_ledger.h"
#include "server/serving/parameter_store.h"
#include "server/serving/server_metrics.h"
#include "server/serving/shared_chunks.h"
#include "server/versions/pinned_versions.h"

namespace layercast::server {

// Makes the bytes of one chunk a FetchLayer stream sends: cast from the
// fp32 master (or copied from a version PinnedVersions kept), measured for
// what the cast lost and checksummed the first time the chunk is cast at a
// version, looked up in the ledger after, and held to the policy's
// max_rel_error. One per stream; the stream's reactor brings the locks.
class ChunkCaster {
 public:
  struct Options {
    uint64_t chunk_bytes = 0;  // the resolved --chunk-bytes
    // What each chunk's cast lost, measured once per chunk and version.
    // Null: measured, and counted in the metrics, on every cast.
    CastErrorLedger* cast_errors = nullptr;
    // The worker's last stream of this layer failed a checksum: trust no
    // kept CRC, checksum every chunk, and put that CRC in `cast_errors` in
    // place of a kept one that differs (which may be what failed).
    bool recast = false;
    // The stream names a dtype of its own (FetchLayerRequest.dtype): its
    // casts are neither measured nor held to the policy's max_rel_error,
    // which bounds the policy's casts.
    bool own_dtype = false;
    // --cast-error-sample-every: of the vectors whose every element casts
    // to a normal value, measure one in this many (CastError::
    // sample_every). Every one when the policy's max_rel_error is below
    // the dtype's unit roundoff, so that the bound gates exactly.
    uint32_t sample_every = 1;
  };

  // Everything referenced must outlive the caster.
  ChunkCaster(const ParameterStore& store, ServerMetrics& metrics, Options options)
      : store_(store), metrics_(metrics), options_(options) {}

  // Casts the key's elements from the master (or copies them from `kept`)
  // into `out`, and sets `*crc` to their CRC-32C when not null (the first
  // cast's, from the ledger, when this chunk was cast at this version
  // before). FAILED_PRECONDITION naming the tensor and the figure when the
  // cast loses more than the policy's max_rel_error; a float16 overflow
  // under overflow=error as CastFromF32 says, naming the tensor.
  // REQUIRES: *crc == 0, the layer's mutex held shared, and `kept` from
  // the stream's SourceOf under it.
  // `placed`: the tensor as the stream lays it out (in key.dtype).
  absl::Status CastInto(const ChunkKey& key, const AssembledTensor& placed,
                        const PinnedVersions::Kept* kept, uint8_t* out, uint32_t* crc) const;

  // Quantizes the key's elements of an 8-bit float tensor as they were at
  // the version `kept` holds (the master's when null) into `out`, codes
  // then scales, as CastInto does; with `measure`, adds what it lost there.
  // Nothing is counted, checked or checksummed: a delta quantizes its base
  // again with it. REQUIRES: IsFloat8(key.dtype), as CastInto's.
  void Quantize(const ChunkKey& key, const AssembledTensor& placed,
                const PinnedVersions::Kept* kept, uint8_t* out, CastError* measure = nullptr) const;

 private:
  const ParameterStore& store_;
  ServerMetrics& metrics_;
  const Options options_;
};

}  // namespace layercast::server
