#include "core/crc32c.h"

#include <cpuid.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <vector>

#include "core/crc32c_kernels.h"

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

}  // namespace

namespace internal {

uint32_t Crc32cTable(const uint8_t* p, size_t size, uint32_t crc) {
  for (size_t i = 0; i < size; ++i) crc = (crc >> 8) ^ kTable[(crc ^ p[i]) & 0xFF];
  return crc;
}

__attribute__((target("sse4.2"))) uint32_t Crc32cInstruction(const uint8_t* p, size_t size,
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

}  // namespace internal

namespace {

bool CpuRuns(Crc32cPath path) {
  __builtin_cpu_init();
  switch (path) {
    case Crc32cPath::kTable:
      return true;
    case Crc32cPath::kInstruction:
      return __builtin_cpu_supports("sse4.2");
    case Crc32cPath::kCarrylessMultiply: {
      // VPCLMULQDQ is CPUID leaf 7 ECX bit 10 (clang 14's
      // __builtin_cpu_supports does not know it); its registers are the
      // AVX-512 ones, whose OS support the "avx512f" check includes.
      unsigned eax, ebx, ecx, edx;
      const bool vpclmulqdq =
          __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 10)) != 0;
      return vpclmulqdq && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("pclmul") &&
             __builtin_cpu_supports("sse4.2");
    }
  }
  return false;
}

// From the list SupportedCrc32cPaths keeps, not CpuRuns: CPUID, which CpuRuns
// executes for VPCLMULQDQ, exits to the hypervisor in a virtual machine,
// about 10 us on the machines we measure on. Paid on every call, it made
// checksums of 48 KiB blocks by carry-less multiplication run at 6.8 GB/s,
// against the crc32 instruction's 24 (63 without it), and Fastest() picked
// the instruction.
bool Supported(Crc32cPath path) {
  const std::vector<Crc32cPath>& paths = SupportedCrc32cPaths();
  return std::find(paths.begin(), paths.end(), path) != paths.end();
}

uint32_t Run(Crc32cPath path, const uint8_t* p, size_t size, uint32_t crc) {
  if (!Supported(path)) path = Crc32cPath::kTable;  // same value, no SIGILL
  switch (path) {
    case Crc32cPath::kTable:
      break;
    case Crc32cPath::kInstruction:
      return internal::Crc32cInstruction(p, size, crc);
    case Crc32cPath::kCarrylessMultiply:
      return internal::Crc32cClmul(p, size, crc);
  }
  return internal::Crc32cTable(p, size, crc);
}

// The fastest path this CPU runs, on what a shard checksums: a block of a
// chunk just cast, in cache (48 KiB). The paths take turns, best of five;
// about a millisecond, once.
Crc32cPath Fastest() {
  const std::vector<Crc32cPath>& paths = SupportedCrc32cPaths();
  if (paths.size() == 1) return paths.front();
  std::vector<uint8_t> block(48 << 10);
  for (size_t i = 0; i < block.size(); ++i) block[i] = static_cast<uint8_t>(i * 131);
  std::vector<double> best(paths.size(), 1e9);
  for (int pass = 0; pass < 5; ++pass) {
    for (size_t i = 1; i < paths.size(); ++i) {  // the table is never the fastest
      const auto start = std::chrono::steady_clock::now();
      for (int repeat = 0; repeat < 4; ++repeat) Run(paths[i], block.data(), block.size(), 0);
      best[i] = std::min(
          best[i], std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  return paths[std::min_element(best.begin(), best.end()) - best.begin()];
}

}  // namespace

const std::vector<Crc32cPath>& SupportedCrc32cPaths() {
  static const std::vector<Crc32cPath>* const paths = [] {
    auto* supported = new std::vector<Crc32cPath>;
    for (Crc32cPath path :
         {Crc32cPath::kTable, Crc32cPath::kInstruction, Crc32cPath::kCarrylessMultiply}) {
      if (CpuRuns(path)) supported->push_back(path);
    }
    return supported;
  }();
  return *paths;
}

Crc32cPath FastestCrc32cPath() {
  static const Crc32cPath fastest = Fastest();
  return fastest;
}

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  return Crc32c(data, size, crc, FastestCrc32cPath());
}

uint32_t Crc32c(const void* data, size_t size, uint32_t crc, Crc32cPath path) {
  return ~Run(path, static_cast<const uint8_t*>(data), size, ~crc);
}

}  // namespace layercast
