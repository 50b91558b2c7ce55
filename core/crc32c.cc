#include "core/crc32c.h"

#include <array>
#include <cstring>

namespace layercast {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // reflected Castagnoli

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? kPolynomial : 0);
    table[i] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = MakeTable();

uint32_t Crc32cTable(const uint8_t* p, size_t size, uint32_t crc) {
  for (size_t i = 0; i < size; ++i) crc = (crc >> 8) ^ kTable[(crc ^ p[i]) & 0xFF];
  return crc;
}

__attribute__((target("sse4.2"))) uint64_t Crc32cWords(const uint8_t* p, size_t words,
                                                       uint64_t crc) {
  for (size_t i = 0; i < words; ++i) {
    uint64_t word;
    std::memcpy(&word, p + 8 * i, 8);
    crc = __builtin_ia32_crc32di(crc, word);
  }
  return crc;
}

// The crc32 instruction has a latency of three cycles and a throughput of
// one, so one dependent chain runs at a third of what the core can do (it was
// a fifth of a shard's CPU per chunk). Three independent chains over
// consecutive stripes, joined by shifting the earlier ones past the later
// stripes, run near the throughput bound. The same scheme as Intel's
// crc_pcl and google/crc32c, which Debian does not package.
constexpr size_t kStripeBytes = 4096;

// Without the pre- and post-inversion the CRC update is linear over GF(2):
// crc(s, A || B) = Shift(crc(s, A), |B|) ^ crc(0, B). Shifting past a stripe
// of zeros is a 32x32 bit matrix, applied a byte at a time from four tables.
struct StripeShift {
  std::array<std::array<uint32_t, 256>, 4> table;

  uint32_t operator()(uint32_t crc) const {
    return table[0][crc & 0xFF] ^ table[1][(crc >> 8) & 0xFF] ^ table[2][(crc >> 16) & 0xFF] ^
           table[3][crc >> 24];
  }
};

__attribute__((target("sse4.2"))) StripeShift MakeStripeShift() {
  static const uint8_t zeros[kStripeBytes] = {};
  std::array<uint32_t, 32> basis;
  for (int bit = 0; bit < 32; ++bit) {
    basis[bit] = static_cast<uint32_t>(Crc32cWords(zeros, kStripeBytes / 8, uint64_t{1} << bit));
  }
  StripeShift shift;
  for (int byte = 0; byte < 4; ++byte) {
    for (uint32_t value = 0; value < 256; ++value) {
      uint32_t out = 0;
      for (int bit = 0; bit < 8; ++bit) {
        if (value & (1u << bit)) out ^= basis[8 * byte + bit];
      }
      shift.table[byte][value] = out;
    }
  }
  return shift;
}

__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const uint8_t* p, size_t size,
                                                          uint32_t crc) {
  static const StripeShift shift = MakeStripeShift();
  constexpr size_t kWords = kStripeBytes / 8;
  uint64_t crc0 = crc;
  while (size >= 3 * kStripeBytes) {
    uint64_t crc1 = 0;
    uint64_t crc2 = 0;
    for (size_t i = 0; i < kWords; ++i) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + 8 * i, 8);
      std::memcpy(&w1, p + kStripeBytes + 8 * i, 8);
      std::memcpy(&w2, p + 2 * kStripeBytes + 8 * i, 8);
      crc0 = __builtin_ia32_crc32di(crc0, w0);
      crc1 = __builtin_ia32_crc32di(crc1, w1);
      crc2 = __builtin_ia32_crc32di(crc2, w2);
    }
    crc0 = shift(shift(static_cast<uint32_t>(crc0)) ^ static_cast<uint32_t>(crc1)) ^
           static_cast<uint32_t>(crc2);
    p += 3 * kStripeBytes;
    size -= 3 * kStripeBytes;
  }
  crc0 = Crc32cWords(p, size / 8, crc0);
  p += size / 8 * 8;
  size %= 8;
  uint32_t crc32 = static_cast<uint32_t>(crc0);
  while (size-- > 0) crc32 = __builtin_ia32_crc32qi(crc32, *p++);
  return crc32;
}

bool HasSse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}

}  // namespace

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  crc = HasSse42() ? Crc32cHardware(p, size, crc) : Crc32cTable(p, size, crc);
  return ~crc;
}

}  // namespace layercast
