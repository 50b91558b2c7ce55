// RelayedVersions: which versions a relay keeps, which it finds for a
// pinned read or a delta's base, and which elements a delta from each
// carries.

#include "relay/relayed_versions.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

namespace layercast::relay {
namespace {

// One layer of one bf16 tensor of 100 elements and one fp32 of 3.
std::vector<AssembledLayout> Layouts() {
  absl::StatusOr<AssembledLayout> layout =
      AssembledLayout::FromDTypes({DType::kBFloat16, DType::kFloat32}, {100, 3});
  EXPECT_TRUE(layout.ok()) << layout.status();
  return {*layout};
}

// The layer's bytes with element `i` of the bf16 tensor set to `value`.
std::vector<uint8_t> With(const AssembledLayout& layout, std::vector<uint8_t> bytes, uint64_t i,
                          uint16_t value) {
  std::memcpy(bytes.data() + layout.tensors()[0].byte_offset + 2 * i, &value, 2);
  return bytes;
}

std::vector<uint64_t> Set(std::initializer_list<uint64_t> elements, uint64_t n) {
  std::vector<uint64_t> bits((n + 63) / 64, 0);
  for (const uint64_t e : elements) bits[e / 64] |= uint64_t{1} << (e % 64);
  return bits;
}

TEST(RelayedVersionsTest, KeepsFindsAndComparesVersions) {
  const std::vector<AssembledLayout> layouts = Layouts();
  RelayedVersions versions(layouts, /*keep=*/3);
  const std::vector<uint8_t> v0(layouts[0].total_bytes(), 0);
  const std::vector<uint8_t> v1 = With(layouts[0], v0, 3, 7);
  const std::vector<uint8_t> v3 = With(layouts[0], With(layouts[0], v1, 3, 0), 70, 9);
  versions.Put(0, 0, true, v0, {11});
  versions.Put(0, 1, true, v1, {11});
  versions.Put(0, 2, false, v1, {11});  // a version that changed nothing
  versions.Put(0, 5, true, v3, {11});   // versions 3 and 4 never pulled

  EXPECT_EQ(versions.Newest(0), 5u);
  EXPECT_EQ(versions.held(), 5u);
  // Version 2 is kept, and it is version 1's values.
  std::optional<HeldLayer> two = versions.At(0, 2);
  ASSERT_TRUE(two.has_value());
  EXPECT_EQ(two->version, 2u);
  EXPECT_EQ(*two->bytes, v1);
  // Versions 3 and 4 came between 2 and 5: never pulled, not inferred.
  EXPECT_FALSE(versions.At(0, 4).has_value());

  // Each delta: what changed, the element that went back to 0 included.
  std::shared_ptr<const ChangedElements> changed =
      versions.ChangedBetween(0, 1, *versions.At(0, 5));
  ASSERT_NE(changed, nullptr);
  EXPECT_EQ(changed->elements[0], Set({3, 70}, 100));
  EXPECT_EQ(changed->elements[1], Set({}, 3));
  changed = versions.ChangedBetween(0, 0, *versions.At(0, 5));
  ASSERT_NE(changed, nullptr);
  EXPECT_EQ(changed->elements[0], Set({3, 70}, 100)) << "element 3 changed and changed back: sent";
  changed = versions.ChangedBetween(0, 1, *versions.At(0, 2));
  ASSERT_NE(changed, nullptr);
  EXPECT_EQ(changed->elements[0], Set({}, 100));
  EXPECT_EQ(versions.ChangedBetween(0, 4, *versions.At(0, 5)), nullptr);
  HeldLayer replaced = *versions.At(0, 5);
  replaced.bytes = std::make_shared<const std::vector<uint8_t>>(v3);
  EXPECT_EQ(versions.ChangedBetween(0, 1, replaced), nullptr) << "not the bytes kept now";

  // Keeps the newest and 3 before it: version 0 goes.
  versions.Put(0, 6, true, With(layouts[0], v3, 99, 1), {11});
  EXPECT_FALSE(versions.At(0, 0).has_value());
  EXPECT_EQ(versions.ChangedBetween(0, 0, *versions.At(0, 6)), nullptr);
  changed = versions.ChangedBetween(0, 5, *versions.At(0, 6));
  ASSERT_NE(changed, nullptr);
  EXPECT_EQ(changed->elements[0], Set({99}, 100));
}

TEST(RelayedVersionsTest, AReadWaitsForItsLayerAndCloseEndsTheWait) {
  const std::vector<AssembledLayout> layouts = Layouts();
  RelayedVersions versions(layouts, 1);
  const std::vector<uint8_t> bytes(layouts[0].total_bytes(), 0);
  EXPECT_FALSE(versions.WaitNewest(0, 0, absl::Now() + absl::Milliseconds(10)).has_value())
      << "nothing landed yet";
  versions.Heading(1);
  EXPECT_EQ(versions.WaitHeading(1, absl::Now()), 1u) << "answered as the walk begins";
  std::thread lands([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    versions.Put(0, 1, true, bytes, {11});
  });
  const std::optional<HeldLayer> landed =
      versions.WaitNewest(0, 1, absl::Now() + absl::Seconds(10));
  lands.join();
  ASSERT_TRUE(landed.has_value());
  EXPECT_EQ(landed->version, 1u);
  EXPECT_EQ(landed->incarnations, std::vector<uint64_t>{11});

  const absl::Time start = absl::Now();
  std::thread closes([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    versions.Close();
  });
  EXPECT_FALSE(versions.WaitNewest(0, 2, absl::Now() + absl::Seconds(30)).has_value());
  closes.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "Close ends a wait at once";
  EXPECT_TRUE(versions.closed());
}

}  // namespace
}  // namespace layercast::relay
