#pragma once

#include <cstddef>
#include <cstdint>

namespace layercast {

// CRC-32C (Castagnoli, as in iSCSI and ext4) of `size` bytes, continuing from
// `crc` (0 to start). Uses the SSE4.2 crc32 instruction when the CPU has it,
// a table otherwise; both give the same value. Thread-safe.
//
// Hand-written because Debian's abseil (20220623) predates absl::crc32c and
// no other library here exposes it.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace layercast
