#pragma once

// Runs a check over every fp32 bit pattern, in blocks spread over the cores:
// what the exhaustive kernel tests share.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "tests/sanitized_build.h"

namespace layercast::exhaustive {

inline constexpr uint64_t kAllPatterns = uint64_t{1} << 32;
inline constexpr size_t kBlock = size_t{1} << 16;  // fits in L2 with its outputs

// An optimised build tests all 2^32 patterns in under a minute of CPU time.
// Sanitizers (ASan+UBSan measured ~4x slower) and unoptimised builds (far
// slower, Eigen especially) test every kBlockStride-th block only: as one
// exponent spans 128 blocks, every exponent of both signs is still tested.
#if !defined(__OPTIMIZE__)
inline constexpr uint64_t kBlockStride = 61;
#elif defined(LAYERCAST_UNDER_SANITIZER)  // tests/sanitized_build.h
inline constexpr uint64_t kBlockStride = 13;
#else
inline constexpr uint64_t kBlockStride = 1;
#endif

// Runs `check(first_bits, scratch)`, with scratch.in (a std::vector<float>
// of kBlock elements that Scratch's constructor sizes) holding the patterns
// from first_bits on, over every kBlockStride-th block of the 2^32 patterns,
// on at least two threads, each with a Scratch of its own reused from block
// to block; returns the first failure found, or "".
template <typename Scratch, typename Check>
std::string ForAllBlocks(Check check) {
  const unsigned workers = std::clamp(std::thread::hardware_concurrency(), 2u, 8u);
  std::vector<std::string> failures(workers);
  auto work = [&](unsigned worker) {
    Scratch scratch;
    for (uint64_t first = kBlock * kBlockStride * worker; first < kAllPatterns;
         first += kBlock * kBlockStride * workers) {
      for (size_t i = 0; i < kBlock; ++i) {
        scratch.in[i] = std::bit_cast<float>(static_cast<uint32_t>(first + i));
      }
      failures[worker] = check(static_cast<uint32_t>(first), scratch);
      if (!failures[worker].empty()) return;
    }
  };
  std::vector<std::thread> threads;
  for (unsigned worker = 1; worker < workers; ++worker) threads.emplace_back(work, worker);
  work(0);
  for (std::thread& thread : threads) thread.join();
  for (const std::string& failure : failures) {
    if (!failure.empty()) return failure;
  }
  return "";
}

}  // namespace layercast::exhaustive
