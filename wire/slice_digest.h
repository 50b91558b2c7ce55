#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>

#include "core/layout.h"

namespace layercast::wire {

// The SHA-256 a shard gives of its slice of one layer (LayerDigest.sha256
// in proto/layercast/v1/shard.proto): for each tensor the shard owns any
// elements of, in layer order, the tensor's index (4 bytes, little-endian),
// the SHA-256 of its owned elements' bytes, and for an 8-bit float tensor
// the SHA-256 of its owned blocks' scales. A shard feeds it chunk by chunk
// as it casts; a reader computes it from the layer it assembled
// (SliceDigestOf), so the two agree on exactly the bytes, whoever carried
// them. A hash of hashes, so that a chunk's codes and scales can be fed in
// the order a chunk holds them.
//
// Not thread-safe; one per slice.
class SliceDigest {
 public:
  using Sha256 = std::array<uint8_t, 32>;

  SliceDigest();
  ~SliceDigest();
  SliceDigest(const SliceDigest&) = delete;
  SliceDigest& operator=(const SliceDigest&) = delete;

  // The next tensor with owned elements begins: `tensor` is its index, and
  // `scaled` says whether it is an 8-bit float (with scales).
  void BeginTensor(uint32_t tensor, bool scaled);
  // Its next owned elements' bytes, in order.
  void AddElements(std::span<const uint8_t> bytes);
  // Its next owned blocks' scales (fp32, little-endian), in order.
  void AddScales(std::span<const uint8_t> bytes);
  // The digest; the object is spent.
  Sha256 Finish();

 private:
  struct Contexts;
  void EndTensor();
  std::unique_ptr<Contexts> contexts_;
  bool in_tensor_ = false;
  bool scaled_ = false;
};

// The digest of shard `shard` of `num_shards`'s slice in `buffer`, a whole
// layer assembled in `layout` (padding ignored).
// REQUIRES: buffer.size() >= layout.total_bytes(); shard < num_shards.
SliceDigest::Sha256 SliceDigestOf(const AssembledLayout& layout, std::span<const uint8_t> buffer,
                                  uint32_t shard, uint32_t num_shards);

}  // namespace layercast::wire
