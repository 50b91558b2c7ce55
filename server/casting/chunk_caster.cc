#include "server/casting/chunk_caster.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/cast.h"
#include "core/cast_error.h"
#include "core/crc32c.h"
#include "core/fp8.h"
#include "platform/log.h"
#include "server/serving/fetch_plan.h"

namespace layercast::server {
namespace {

// Casts run in blocks whose output stays in the core's cache, so the CRC
// reads it back from there instead of from memory: 48 KiB of bfloat16, four
// of Crc32c's three-stripe blocks.
constexpr uint64_t kCastBlockElements = 24 << 10;

// The elements of the whole blocks of an 8-bit float tensor that `chunk`
// touches. They lie within the shard's slice: ParameterStore refuses a
// layout whose shards split a block.
ElementRange WholeBlocks(const AssembledTensor& placed, ElementRange chunk) {
  const uint64_t block = placed.block_size;
  return {chunk.begin / block * block,
          std::min((chunk.end + block - 1) / block * block, placed.num_elements)};
}

// Quantizes elements `chunk` of an 8-bit float tensor `placed` from
// `values`, the fp32 of WholeBlocks(placed, chunk) or more, element `base`
// first, into `out`: the codes, then the scale of every block they touch,
// each from its whole block wherever the chunk starts or ends.
void QuantizeChunk(const AssembledTensor& placed, ElementRange chunk, const float* values,
                   uint64_t base, uint8_t* out, CastError* measure) {
  const uint64_t block = placed.block_size;
  const Fp8Format format = Fp8FormatOf(placed.compute_dtype);
  const uint64_t first_block = chunk.begin / block;
  const uint64_t blocks = (chunk.end + block - 1) / block - first_block;
  thread_local std::vector<float> scales;
  scales.resize(blocks);
  if (chunk.begin % block == 0 && (chunk.end % block == 0 || chunk.end == placed.num_elements)) {
    // Whole blocks: the chunk's own, as a tensor's from its element 0.
    QuantizeFp8({values + (chunk.begin - base), chunk.size()}, block, format, {out, chunk.size()},
                scales, measure);
  } else {
    for (uint64_t b = 0; b < blocks; ++b) {
      const ElementRange whole{(first_block + b) * block,
                               std::min((first_block + b + 1) * block, placed.num_elements)};
      scales[b] = Fp8BlockScale({values + (whole.begin - base), whole.size()}, format);
      const ElementRange part = Intersect(whole, chunk);
      const std::span<const float> src{values + (part.begin - base), part.size()};
      const std::span<uint8_t> codes{out + (part.begin - chunk.begin), part.size()};
      QuantizeFp8WithScale(src, scales[b], format, codes);
      if (measure != nullptr) MeasureFp8Error(src, codes, scales[b], format, measure);
    }
  }
  // Little-endian fp32, as the wire says; `out` past the codes may be
  // unaligned.
  std::memcpy(out + chunk.size(), scales.data(), blocks * sizeof(float));
}
}  // namespace

void ChunkCaster::Quantize(const ChunkKey& key, const AssembledTensor& placed,
                           const PinnedVersions::Kept* kept, uint8_t* out,
                           CastError* measure) const {
  // Quantized from the master, or from the fp32 a change kept (KeptDType):
  // its blocks copied out first, as the kept bits may put them at any byte
  // offset.
  const ElementRange owned = store_.owned(key.layer, key.tensor);
  const ElementRange elements{key.element_begin, key.element_begin + key.elements};
  const float* values = store_.master(key.layer, key.tensor);
  uint64_t base = owned.begin;
  thread_local std::vector<float> kept_values;
  if (kept != nullptr) {
    const ElementRange blocks = WholeBlocks(placed, elements);
    kept_values.resize(blocks.size());
    std::memcpy(kept_values.data(),
                kept->tensor(key.tensor) + (blocks.begin - owned.begin) * sizeof(float),
                blocks.size() * sizeof(float));
    values = kept_values.data();
    base = blocks.begin;
  }
  QuantizeChunk(placed, elements, values, base, out, measure);
}

absl::Status ChunkCaster::CastInto(const ChunkKey& key, const AssembledTensor& placed,
                                   const PinnedVersions::Kept* kept, uint8_t* out,
                                   uint32_t* crc) const {
  const ElementRange owned = store_.owned(key.layer, key.tensor);
  const uint64_t skip = key.element_begin - owned.begin;
  const size_t element_bytes = DTypeSize(key.dtype);
  const ElementRange elements{key.element_begin, key.element_begin + key.elements};
  if (kept != nullptr && !IsFloat8(key.dtype)) {
    // Kept in the compute dtype already (cast from the master before the
    // change), so the bytes are what a cast at that version gave; a stream
    // in a dtype of its own gets here only when that is the kept width
    // (FetchPlan::kept_bits_serve).
    const uint8_t* source = kept->tensor(key.tensor) + skip * element_bytes;
    std::memcpy(out, source, key.elements * element_bytes);
    if (crc != nullptr) *crc = Crc32c(out, key.elements * element_bytes, *crc);
    return absl::OkStatus();
  }
  const auto cast_start = std::chrono::steady_clock::now();
  // The same chunk at the same version casts to the same bits: measured and
  // checksummed the first time only (checksummed again in a recast stream). Only chunks of the grid
  // (ChunkGrid) are kept and counted: a ranged or resumed stream's part of one would count its
  // elements again.
  const bool narrows = key.dtype != DType::kFloat32;
  const bool on_grid = ChunkGrid(options_.chunk_bytes, placed, owned).IsChunk(elements);
  const std::optional<CastErrorLedger::Known> known =
      on_grid && options_.cast_errors != nullptr ? options_.cast_errors->Find(key) : std::nullopt;
  CastError measured;
  const std::optional<float> bound = store_.policy().max_rel_error();
  measured.sample_every =
      bound.has_value() && *bound < RelativeErrorBound(key.dtype) ? 1 : options_.sample_every;
  CastError* const measure =
      narrows && !known.has_value() && !options_.own_dtype ? &measured : nullptr;
  // The CRC pass, like the measurement, runs on a chunk's first cast at a
  // version only, and on every cast of a recast stream: its worker saw a
  // chunk fail its check, and the kept CRC may be what went bad.
  const bool crc_known =
      crc != nullptr && !options_.recast && known.has_value() && known->crc32c.has_value();
  uint32_t* const checksum = crc_known ? nullptr : crc;
  if (IsFloat8(key.dtype)) {
    Quantize(key, placed, kept, out, measure);
    if (checksum != nullptr) *checksum = Crc32c(out, SentBytes(placed, elements), *checksum);
  } else {
    const float* source = store_.master(key.layer, key.tensor) + skip;
    for (uint64_t done = 0; done < key.elements;) {
      const uint64_t block = std::min(kCastBlockElements, key.elements - done);
      uint8_t* block_out = out + done * element_bytes;
      if (absl::Status cast = CastFromF32(source + done, block_out, block, key.dtype,
                                          store_.policy().overflow(), measure);
          !cast.ok()) {
        const std::string& name = store_.model().layers[key.layer].tensors[key.tensor].name;
        return absl::Status(
            cast.code(), absl::StrCat("tensor ", name, " (from element ", key.element_begin + done,
                                      "): ", cast.message(),
                                      "; the policy's float16 overflow rule is 'error': set "
                                      "overflow=saturate or override this tensor to float32"));
      }
      if (checksum != nullptr) *checksum = Crc32c(block_out, block * element_bytes, *checksum);
      done += block;
    }
  }
  metrics_.RecordCast(
      key.elements,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - cast_start).count());
  metrics_.RecordChunkCast();
  const std::optional<uint32_t> computed_crc =
      crc != nullptr && !crc_known ? std::optional<uint32_t>(*crc) : std::nullopt;
  if (measure != nullptr && on_grid &&
      (options_.cast_errors == nullptr ||
       options_.cast_errors->Record(key, measured, computed_crc))) {
    metrics_.RecordCastError(key.layer, key.dtype, measured);
  } else if (on_grid && options_.cast_errors != nullptr && computed_crc.has_value()) {
    // The CRC of a chunk that narrows nothing, or that a delta measured.
    options_.cast_errors->Record(key, known.has_value() ? known->error : measured, computed_crc);
  }
  // A kept CRC that differs from a fresh cast's can only have come from a
  // fault: keep the fresh one.
  if (options_.recast && on_grid && options_.cast_errors != nullptr && computed_crc.has_value() &&
      options_.cast_errors->ReplaceCrc(key, *computed_crc)) {
    Log()->warn(
        "layer {} tensor {} elements [{}, {}) at version {}: the CRC kept for the chunk differed "
        "from its cast's (a worker saw the chunk fail its checksum and asked for a fresh cast); "
        "the cast's CRC is kept now",
        key.layer, key.tensor, key.element_begin, key.element_begin + key.elements, key.version);
  }
  if (crc_known) *crc = *known->crc32c;
  const CastError& error = known.has_value() ? known->error : measured;
  if (bound.has_value() && !options_.own_dtype && error.Exceeds(*bound)) {
    const std::string& name = store_.model().layers[key.layer].tensors[key.tensor].name;
    const std::string figure =
        error.overflowed > 0
            ? absl::StrCat(error.overflowed, " element(s) that overflowed")
            : absl::StrFormat("a relative error of %.3g", error.max_relative_error);
    return absl::FailedPreconditionError(absl::StrFormat(
        "layer %d (%s) loses too much in its cast to %s: tensor %s, elements [%d, %d), has %s, "
        "beyond the policy's max_rel_error=%.3g (%s); serve the tensor in a wider dtype (a policy "
        "override such as '%s=float32') or raise the bound",
        key.layer, store_.model().layers[key.layer].name, DTypeName(key.dtype), name,
        key.element_begin, key.element_begin + key.elements, figure, *bound, error.Describe(),
        name));
  }
  return absl::OkStatus();
}

}  // namespace layercast::server
