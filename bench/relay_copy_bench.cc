// A relay's cost per moved layer: RelayedVersions::Put with the deltas'
// marks (a new version written into the evicted one's buffer, only the
// 4 KiB blocks where something moved since copied), against the same Put
// without marks (the whole layer copied into that buffer), in the same
// run.
//
// One 32 MiB bfloat16 layer of four tensors, --keep-versions 2, 40
// versions a round. Each version moves elements at random: over the whole
// layer at 0.01%, 1% and 20% (an AdamW step moves 1-20% of bf16 values:
// bench/delta_bench), or 5% of one tensor of the four (a tensor the others
// train around, rows few tokens touch). The marked run includes making and
// marking the marks as the gather's decoder does.
//
// Usage: relay_copy_bench [--rounds R]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/changed_elements.h"
#include "relay/relayed_versions.h"

namespace layercast {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kTensorElements = 4ull << 20;
constexpr uint32_t kTensors = 4;
constexpr uint32_t kVersions = 40;

struct Pattern {
  const char* name;
  double share;      // of the elements of the tensors that move
  uint32_t tensors;  // that move: the first ones
};

// Seconds per Put (best round of `rounds`) and the bytes each copied.
std::pair<double, double> PerPut(const std::vector<AssembledLayout>& layouts,
                                 const Pattern& pattern, bool marked, int rounds) {
  std::mt19937_64 random(7);
  std::vector<uint8_t> bytes(layouts[0].total_bytes());
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(random());
  double best = 1e9, copied = 0;
  for (int round = 0; round < rounds; ++round) {
    relay::RelayedVersions versions(layouts, /*keep=*/2);
    versions.Put(0, 0, true, bytes, {1});
    double spent = 0;
    copied = 0;
    for (uint32_t v = 1; v <= kVersions; ++v) {
      std::vector<std::vector<uint64_t>> moved(kTensors);
      const auto count = static_cast<uint64_t>(pattern.share * kTensorElements);
      for (uint32_t t = 0; t < pattern.tensors; ++t) {
        for (uint64_t i = 0; i < count; ++i) moved[t].push_back(random() % kTensorElements);
        std::sort(moved[t].begin(), moved[t].end());
        moved[t].erase(std::unique(moved[t].begin(), moved[t].end()), moved[t].end());
        for (const uint64_t i : moved[t]) {
          bytes[layouts[0].tensors()[t].byte_offset + 2 * i] ^= 1;
        }
      }
      const auto start = Clock::now();
      std::shared_ptr<ChangedElements> marks;
      if (marked) {
        marks = std::make_shared<ChangedElements>(ChangedElements::For(layouts[0]));
        for (uint32_t t = 0; t < kTensors; ++t) MarkIndices(marks->elements[t], 0, moved[t]);
      }
      const uint64_t put = versions.Put(0, v, true, bytes, {1}, marks);
      spent += std::chrono::duration<double>(Clock::now() - start).count();
      if (v > 3) copied += static_cast<double>(put);  // once a version was evicted
    }
    best = std::min(best, spent / kVersions);
  }
  return {best, copied / (kVersions - 3)};
}

}  // namespace
}  // namespace layercast

int main(int argc, char** argv) {
  using namespace layercast;
  int rounds = 3;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--rounds") rounds = std::max(1, std::atoi(argv[i + 1]));
  }
  absl::StatusOr<AssembledLayout> layout =
      AssembledLayout::FromDTypes(std::vector<DType>(kTensors, DType::kBFloat16),
                                  std::vector<uint64_t>(kTensors, kTensorElements));
  if (!layout.ok()) {
    std::fprintf(stderr, "relay_copy_bench: %s\n", std::string(layout.status().message()).c_str());
    return 1;
  }
  const std::vector<AssembledLayout> layouts = {*layout};
  const double mib = static_cast<double>(layout->total_bytes()) / (1 << 20);
  std::printf(
      "relay_copy_bench: one %.0f MiB bf16 layer of %u tensors, keep 2, %u versions, "
      "best of %d rounds\n",
      mib, kTensors, kVersions, rounds);
  std::printf("%-24s %12s %12s %14s %8s\n", "moved", "whole ms", "marked ms", "marked MiB",
              "ratio");
  for (const Pattern& pattern :
       {Pattern{"0.01% of the layer", 0.0001, kTensors}, Pattern{"1% of the layer", 0.01, kTensors},
        Pattern{"20% of the layer", 0.2, kTensors}, Pattern{"5% of 1 tensor of 4", 0.05, 1}}) {
    const auto [whole, whole_bytes] = PerPut(layouts, pattern, /*marked=*/false, rounds);
    const auto [marked, marked_bytes] = PerPut(layouts, pattern, /*marked=*/true, rounds);
    std::printf("%-24s %12.3f %12.3f %14.2f %7.2fx\n", pattern.name, whole * 1e3, marked * 1e3,
                marked_bytes / (1 << 20), marked / whole);
  }
  return 0;
}
