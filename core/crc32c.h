#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace layercast {

// CRC-32C (Castagnoli, as in iSCSI and ext4) of `size` bytes, continuing from
// `crc` (0 to start), by the fastest path this CPU runs. Every path gives the
// same value. Thread-safe.
//
// Hand-written because Debian's abseil (20220623) predates absl::crc32c and
// no other library here exposes it.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

enum class Crc32cPath {
  kTable,              // a byte at a time; any CPU
  kInstruction,        // SSE4.2's crc32, three stripes at once
  kCarrylessMultiply,  // AVX-512 VPCLMULQDQ folding, 256 bytes a turn
};

// Paths this CPU runs, kTable first.
const std::vector<Crc32cPath>& SupportedCrc32cPaths();
// The one Crc32c uses: measured once, at first use (about a millisecond).
Crc32cPath FastestCrc32cPath();
// With a given path, for tests and benchmarks; a path this CPU lacks runs
// kTable (same value).
uint32_t Crc32c(const void* data, size_t size, uint32_t crc, Crc32cPath path);

}  // namespace layercast
