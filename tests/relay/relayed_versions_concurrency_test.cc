// RelayedVersions under readers: streams take the newest or an older
// version and let go on their own threads while the mirror's thread writes
// each new version, in place when no one holds the newest and into a new
// buffer when someone does. No reader may ever see a version's number on
// another version's bits. Also run under ThreadSanitizer (label
// concurrency).

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "relay/relayed_versions.h"

namespace layercast::relay {
namespace {

// Version v's bytes: every bf16 value v (a layer no delta could confuse
// with another version's).
std::vector<uint8_t> Filled(const AssembledLayout& layout, uint64_t version) {
  std::vector<uint8_t> bytes(layout.total_bytes(), 0);
  const uint16_t value = static_cast<uint16_t>(version);
  for (uint64_t i = 0; i < layout.tensors()[0].num_elements; ++i) {
    std::memcpy(bytes.data() + layout.tensors()[0].byte_offset + 2 * i, &value, 2);
  }
  return bytes;
}

TEST(RelayedVersionsConcurrencyTest, ReadersNeverSeeAVersionsNumberOnAnothersBits) {
  absl::StatusOr<AssembledLayout> layout =
      AssembledLayout::FromDTypes({DType::kBFloat16}, {1 << 18});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<AssembledLayout> layouts = {*layout};
  RelayedVersions versions(layouts, /*keep=*/2);
  versions.Put(0, 1, true, Filled(*layout, 1), {11});
  constexpr uint64_t kVersions = 200;
  std::atomic<bool> done{false};
  std::atomic<uint64_t> reads{0}, torn{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&, r] {
      // Bounded: the writer's versions end it, and at most this many reads.
      for (int i = 0; i < 200'000 && !done.load(); ++i) {
        const uint64_t newest = versions.Newest(0);
        std::optional<HeldLayer> held =
            r == 0 ? versions.WaitNewest(0, 0, absl::InfinitePast())
                   : versions.At(0, newest > 1 ? newest - 1 - (i % 2) : newest);
        if (!held || held->bytes == nullptr) continue;
        if (*held->bytes != Filled(*layout, held->version)) ++torn;
        ++reads;
      }
    });
  }
  for (uint64_t v = 2; v <= kVersions; ++v) versions.Put(0, v, true, Filled(*layout, v), {11});
  done = true;
  for (std::thread& reader : readers) reader.join();
  EXPECT_GT(reads.load(), 0u);
  EXPECT_EQ(torn.load(), 0u) << "a version's number on another version's bits";
  EXPECT_EQ(*versions.At(0, kVersions)->bytes, Filled(*layout, kVersions));
  EXPECT_EQ(*versions.At(0, kVersions - 2)->bytes, Filled(*layout, kVersions - 2));
}

}  // namespace
}  // namespace layercast::relay
