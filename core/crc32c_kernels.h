#pragma once

#include <cstddef>
#include <cstdint>

// The ways behind core/crc32c.h. Each continues from `crc` as the register
// holds it (inverted on the way in and out by Crc32c, not here) and gives the
// same value. The carry-less one lives in a file compiled for AVX-512 and
// VPCLMULQDQ, so it may only be called once the CPU is known to have them.

namespace layercast::internal {

uint32_t Crc32cTable(const uint8_t* p, size_t size, uint32_t crc);
// SSE4.2's crc32 instruction, three stripes at once.
uint32_t Crc32cInstruction(const uint8_t* p, size_t size, uint32_t crc);
// VPCLMULQDQ folding, 256 bytes a turn; shorter inputs go to the instruction.
uint32_t Crc32cClmul(const uint8_t* p, size_t size, uint32_t crc);

}  // namespace layercast::internal
