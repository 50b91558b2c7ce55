#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/layout.h"

namespace layercast {

// Per tensor of a layer, one bit per element (bit i % 64 of word i / 64):
// the elements that may differ between two versions of it; for an 8-bit
// float tensor, its codes, and in `scales` one bit per block scale (empty
// for other tensors). A superset is allowed: marking an element that did
// not change costs a copy, never a wrong value.
struct ChangedElements {
  ChangedElements() = default;
  explicit ChangedElements(size_t tensors) : elements(tensors), scales(tensors) {}
  // Sized for `layout`, nothing marked.
  static ChangedElements For(const AssembledLayout& layout);

  // Marks what `other` marks (both of one layout, or `other` empty).
  void Add(const ChangedElements& other);
  // Elements and block scales marked.
  uint64_t Count() const;

  std::vector<std::vector<uint64_t>> elements, scales;
};

// Mark bits of `bits` from bit `first`; bits past its end are not marked.
// Atomic per word: a gather's streams mark one tensor from several threads
// at once, and a word may hold the elements of two shards.
//
// Bits [first, first + count).
void MarkRange(std::span<uint64_t> bits, uint64_t first, uint64_t count);
// Bit first + i for each bit i set in `bitmap` (bit i % 8 of byte i / 8).
void MarkBitmap(std::span<uint64_t> bits, uint64_t first, std::span<const uint8_t> bitmap);
// Bit first + i for each i in `indices`, ascending.
void MarkIndices(std::span<uint64_t> bits, uint64_t first, std::span<const uint64_t> indices);

// Copies from `from` into `to` (both a layer in `layout`) every 4 KiB
// block of a tensor in which any of `changed` marks an element, and a
// tensor's block scales where any is marked. Blocks, not elements: a
// streaming copy of a block costs about what one scattered element's
// cache miss does, so scattered changes cost at most a whole copy (plus
// reading the marks), and changes that cluster (a tensor that did not
// train, rows no token touched) cost only their blocks. Returns the bytes
// copied.
uint64_t CopyChanged(const AssembledLayout& layout, std::span<const ChangedElements* const> changed,
                     const uint8_t* from, uint8_t* to);

}  // namespace layercast
