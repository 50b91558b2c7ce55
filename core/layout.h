#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/model.h"
#include "core/policy.h"

namespace layercast {

// Byte alignment of every tensor in an assembled layer buffer.
inline constexpr uint64_t kAssembledAlignment = 256;

// The most bytes one assembled layer may take: 2^48 = 256 TiB. Layouts come
// from manifests a worker does not trust, and a layer's size decides what it
// allocates. This is beyond any host's or device's memory (twice what an
// x86-64 Linux process can map), so no real layer is refused; and it keeps
// every offset, tensor end and aligned size of a built layout far below 2^64,
// so arithmetic on a built layout cannot wrap.
inline constexpr uint64_t kMaxAssembledLayerBytes = uint64_t{1} << 48;

// A half-open range [begin, end) of flat elements within one tensor.
struct ElementRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  friend bool operator==(const ElementRange&, const ElementRange&) = default;
};

// The elements of an `n`-element tensor that shard `shard` of `num_shards`
// owns: [n*shard/num_shards, n*(shard+1)/num_shards). Balanced to one element;
// empty when n < num_shards for some shards. REQUIRES: shard < num_shards.
ElementRange ShardElementRange(uint64_t n, uint32_t shard, uint32_t num_shards);

// Intersection of two element ranges (empty when they do not meet).
ElementRange Intersect(ElementRange a, ElementRange b);

// Where one tensor sits in an assembled layer buffer. In an AssembledLayout,
// byte_offset + num_bytes() is at most kMaxAssembledLayerBytes, so neither
// the product nor the sum can wrap (the layout refused anything larger).
//
// An 8-bit float tensor (IsFloat8) also has its block scales in the buffer:
// one little-endian fp32 per block of `block_size` elements from element 0
// (core/fp8.h), at the next aligned offset after its codes. Scales are not
// elements: a byte range selects the codes it covers, and whoever sends
// those codes sends the scales of their blocks with them.
struct AssembledTensor {
  DType compute_dtype = DType::kFloat32;
  uint64_t byte_offset = 0;  // multiple of kAssembledAlignment
  uint64_t num_elements = 0;
  uint32_t block_size = 0;    // 8-bit floats only, else 0
  uint64_t scale_offset = 0;  // 8-bit floats only: multiple of kAssembledAlignment
  uint64_t num_bytes() const { return num_elements * DTypeSize(compute_dtype); }
  uint64_t num_blocks() const {
    return block_size == 0 ? 0 : (num_elements + block_size - 1) / block_size;
  }
  uint64_t scale_bytes() const { return num_blocks() * sizeof(float); }
};

// Elements of one tensor selected by a byte range of the assembled layout.
struct TensorElementRange {
  uint32_t tensor = 0;  // index into the layer's tensors
  ElementRange elements;
};

// The assembled layout of one layer: tensors in manifest order, each in its
// compute dtype, each at a 256-byte aligned offset, no overlaps, the whole at
// most kMaxAssembledLayerBytes. Both sides derive it from the manifest.
// Immutable and thread-safe once built.
class AssembledLayout {
 public:
  // Lays out `layer` with each tensor's compute dtype from `policy`. Errors
  // as FromDTypes, prefixed with the layer's name.
  static absl::StatusOr<AssembledLayout> Build(const LayerSpec& layer, const Policy& policy);
  // Lays out tensors with explicit compute dtypes and element counts, which
  // may come from an untrusted peer: every product and sum is checked;
  // 8-bit float tensors get scales for blocks of `fp8_block` elements.
  // INVALID_ARGUMENT naming the tensor and the figures when the layer would
  // exceed kMaxAssembledLayerBytes (or 2^64 on the way there), when the
  // two vectors differ in length, or when an 8-bit float tensor comes with
  // an fp8_block the policy grammar does not allow.
  static absl::StatusOr<AssembledLayout> FromDTypes(const std::vector<DType>& dtypes,
                                                    const std::vector<uint64_t>& num_elements,
                                                    uint32_t fp8_block = kDefaultFp8Block);

  const std::vector<AssembledTensor>& tensors() const { return tensors_; }
  // Size of the assembled buffer in bytes: the end of the last tensor,
  // rounded up to kAssembledAlignment.
  uint64_t total_bytes() const { return total_bytes_; }

  // Maps the byte range [begin, end) of the assembled layout to the elements
  // it covers, tensor by tensor (tensors it does not touch are omitted). Bytes
  // in alignment padding select nothing. INVALID_ARGUMENT when the range is
  // empty, reversed or beyond total_bytes(), or when either end falls inside an
  // element; the message says which end and the valid bounds.
  absl::StatusOr<std::vector<TensorElementRange>> MapByteRange(uint64_t begin, uint64_t end) const;

  // Splits [0, total_bytes()) into `parts` contiguous byte ranges of nearly
  // equal size whose boundaries are multiples of kAssembledAlignment, so
  // each is valid for MapByteRange (some may be empty for tiny layers).
  std::vector<std::pair<uint64_t, uint64_t>> SplitBytes(uint32_t parts) const;

 private:
  std::vector<AssembledTensor> tensors_;
  uint64_t total_bytes_ = 0;
};

// The layout a worker pushes a layer's gradient in: `served`'s tensors in
// order, each 8-bit float one in float32 instead (codes cannot hold a
// gradient: they have no scales of their own, and a shard takes FLOAT32 for
// any tensor), the others in their compute dtype; the same layout when no
// tensor is 8-bit. INVALID_ARGUMENT, as FromDTypes, when the wider tensors
// would exceed kMaxAssembledLayerBytes.
absl::StatusOr<AssembledLayout> GradientLayout(const AssembledLayout& served);

// `served`'s tensors, every one in `dtype` (8-bit floats with scales for
// blocks of `fp8_block`): the layout of a pull that names its dtype
// (FetchLayerRequest.dtype), such as the fp32 master an export reads.
// Errors as FromDTypes.
absl::StatusOr<AssembledLayout> LayoutIn(const AssembledLayout& served, DType dtype,
                                         uint32_t fp8_block);

// Whether every 8-bit float tensor of `layer` (laid out as `layout`) is cut
// into shard slices that start on its block boundaries for `num_shards`
// shards: a shard quantizes its own blocks, so no block may straddle two
// shards. FAILED_PRECONDITION naming the first tensor and shard that break
// it, and the fixes (an override to a 16-bit dtype, another shard count or
// fp8_block).
absl::Status CheckBlocksWithinShards(const LayerSpec& layer, const AssembledLayout& layout,
                                     uint32_t num_shards);

// Every layer's layout under `policy`, each checked by CheckBlocksWithinShards
// for `num_shards`: what a shard lays out as it loads, and what
// `layercast-shard --dry-run` checks before it. The first error, as those
// two return it.
absl::StatusOr<std::vector<AssembledLayout>> ShardedLayouts(const ModelSpec& model,
                                                            const Policy& policy,
                                                            uint32_t num_shards);

// SHA-256 over every layer's assembled layout: tensor names, shapes, compute
// dtypes, offsets and sizes (and 8-bit floats' block sizes and scale
// offsets), in order. Two peers agree on how to assemble every
// layer iff their digests are equal. A layer that cannot be laid out has no
// digest: Build's error.
absl::StatusOr<std::array<uint8_t, 32>> LayoutDigest(const ModelSpec& model, const Policy& policy);

}  // namespace layercast
