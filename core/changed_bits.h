#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace layercast {

// One bit per element of the `n` elements of `now` and `was` (`size` bytes
// each: 1, 2 or 4), bit i % 64 of word i / 64 of `bits` (resized and
// cleared first): set where the two differ. What a delta sends is found by
// it: the changed bfloat16 values of a layer a relay holds twice, or the
// changed 8-bit codes and block scales of a quantized span.
void MarkChangedBits(const uint8_t* now, const uint8_t* was, uint64_t n, size_t size,
                     std::vector<uint64_t>& bits);

// As MarkChangedBits, into bits [first, first + n) of `bits`, which keeps
// what it held (bits are only set): a shard's change log marks a layer's
// slice block by block this way. Returns how many differ.
// REQUIRES: bits.size() * 64 >= first + n.
uint64_t MarkChangedBitsFrom(const uint8_t* now, const uint8_t* was, uint64_t n, size_t size,
                             uint64_t first, std::vector<uint64_t>& bits);

}  // namespace layercast
