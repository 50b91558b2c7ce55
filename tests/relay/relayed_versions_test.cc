// RelayedVersions: which versions a relay keeps, which it finds for a
// pinned read or a delta's base, and which elements a delta from each
// carries.

#include "relay/relayed_versions.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "core/fp8.h"
#include "server/serving/memory_budget.h"

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
  const HeldLayer replaced = *versions.At(0, 5);
  versions.Put(0, 5, true, v3, {11});  // pulled again: a torn pull repaired
  EXPECT_EQ(versions.ChangedBetween(0, 1, replaced), nullptr) << "not the entry kept now";
  changed = versions.ChangedBetween(0, 1, *versions.At(0, 5));
  ASSERT_NE(changed, nullptr);
  EXPECT_EQ(changed->elements[0], Set({3, 70}, 100)) << "the repair's changes, from version 2";

  // Keeps the newest and 3 before it: version 0 goes.
  versions.Put(0, 6, true, With(layouts[0], v3, 99, 1), {11});
  EXPECT_FALSE(versions.At(0, 0).has_value());
  EXPECT_EQ(versions.ChangedBetween(0, 0, *versions.At(0, 6)), nullptr);
  changed = versions.ChangedBetween(0, 5, *versions.At(0, 6));
  ASSERT_NE(changed, nullptr);
  EXPECT_EQ(changed->elements[0], Set({99}, 100));
}

// A layer as a publish leaves it: each byte of its values (and fp8 block
// scales) moved with probability `moved`; the alignment padding between
// tensors, which no chunk writes, as it was.
std::vector<uint8_t> Publish(const AssembledLayout& layout, std::vector<uint8_t> bytes,
                             double moved, std::mt19937& random) {
  std::bernoulli_distribution move(moved);
  const auto region = [&](uint64_t offset, uint64_t size) {
    for (uint64_t i = offset; i < offset + size; ++i) {
      if (move(random)) bytes[i] = static_cast<uint8_t>(random());
    }
  };
  for (const AssembledTensor& tensor : layout.tensors()) {
    region(tensor.byte_offset, tensor.num_elements * DTypeSize(tensor.compute_dtype));
    if (tensor.block_size != 0) {
      region(tensor.scale_offset,
             Fp8BlockCount(tensor.num_elements, tensor.block_size) * sizeof(float));
    }
  }
  return bytes;
}

// Whether element `i` of region (offset, size) differs between two layers.
bool Differs(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, uint64_t offset,
             size_t size, uint64_t i) {
  return std::memcmp(a.data() + offset + i * size, b.data() + offset + i * size, size) != 0;
}

bool Marked(const std::vector<uint64_t>& bits, uint64_t i) {
  return (bits[i / 64] >> (i % 64)) & 1;
}

// The relay keeps one copy of a layer and, per version before it, the
// values that the next version changed: every version it keeps must come
// back bit for bit, and every delta must mark at least what differs.
TEST(RelayedVersionsTest, EveryKeptVersionComesBackExactlyFromOneCopyAndItsLogs) {
  absl::StatusOr<AssembledLayout> layout = AssembledLayout::FromDTypes(
      {DType::kBFloat16, DType::kFloat32, DType::kFloat8E4M3FN}, {1000, 37, 300});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<AssembledLayout> layouts = {*layout};
  RelayedVersions versions(layouts, /*keep=*/3);
  std::mt19937 random(7);
  std::map<uint64_t, std::vector<uint8_t>> put;  // version -> bytes
  std::vector<uint8_t> bytes =
      Publish(*layout, std::vector<uint8_t>(layout->total_bytes()), 1, random);
  const double moves[] = {0.01, 0, 1, 0.2, 0.001, 0, 0.05, 0.5, 0.01, 0.3, 0, 0.02};
  uint64_t version = 0;
  versions.Put(0, version, true, bytes, {11});
  put[version] = bytes;
  for (const double moved : moves) {
    version += 1 + random() % 2;  // some versions never pulled
    bytes = Publish(*layout, bytes, moved, random);
    versions.Put(0, version, moved != 0, bytes, {11});
    put[version] = bytes;
    if (version % 3 == 0) {  // a torn pull repaired, to other bits
      bytes = Publish(*layout, bytes, 0.01, random);
      versions.Put(0, version, true, bytes, {11});
      put[version] = bytes;
    }
    // Each kept version: its bytes exactly, and what a delta from it marks.
    std::vector<uint64_t> kept;
    for (const auto& [v, b] : put) {
      if (versions.Identity(0, v).has_value()) kept.push_back(v);
    }
    ASSERT_EQ(kept.size(), std::min<size_t>(put.size(), 4)) << "the newest and 3 before it";
    ASSERT_EQ(kept.back(), version);
    const HeldLayer newest = *versions.WaitNewest(0, version, absl::Now());
    for (const uint64_t v : kept) {
      const std::optional<HeldLayer> at = versions.At(0, v);
      ASSERT_TRUE(at.has_value()) << v;
      ASSERT_EQ(*at->bytes, put[v]) << "version " << v << " after " << version;
      std::shared_ptr<const ChangedElements> changed = versions.ChangedBetween(0, v, newest);
      ASSERT_NE(changed, nullptr) << v;
      for (size_t t = 0; t < layout->tensors().size(); ++t) {
        const AssembledTensor& tensor = layout->tensors()[t];
        for (uint64_t i = 0; i < tensor.num_elements; ++i) {
          ASSERT_TRUE(
              !Differs(put[v], bytes, tensor.byte_offset, DTypeSize(tensor.compute_dtype), i) ||
              Marked(changed->elements[t], i))
              << "tensor " << t << " element " << i << " from " << v << " to " << version;
        }
        for (uint64_t b = 0;
             tensor.block_size != 0 && b < Fp8BlockCount(tensor.num_elements, tensor.block_size);
             ++b) {
          ASSERT_TRUE(!Differs(put[v], bytes, tensor.scale_offset, sizeof(float), b) ||
                      Marked(changed->scales[t], b))
              << "tensor " << t << " scale " << b;
        }
      }
    }
  }
}

// Memory: one copy of the layer and logs of what moved, not a copy per
// kept version; a second copy only while a stream sends the old bytes.
TEST(RelayedVersionsTest, HoldsOneCopyAndTheLogsOfWhatMoved) {
  absl::StatusOr<AssembledLayout> layout =
      AssembledLayout::FromDTypes({DType::kBFloat16}, {1 << 20});
  ASSERT_TRUE(layout.ok()) << layout.status();
  const std::vector<AssembledLayout> layouts = {*layout};
  boost::asio::io_context io;
  server::MemoryBudget budget(std::nullopt, 0, io.get_executor());
  const double copy = static_cast<double>(layout->total_bytes());
  std::mt19937 random(3);
  std::vector<uint8_t> bytes =
      Publish(*layout, std::vector<uint8_t>(layout->total_bytes()), 1, random);
  {
    RelayedVersions versions(layouts, /*keep=*/2);
    versions.SetBudget(&budget);
    versions.Put(0, 1, true, bytes, {11});
    for (uint64_t v = 2; v <= 6; ++v) {
      bytes = Publish(*layout, bytes, 0.01, random);
      versions.Put(0, v, true, bytes, {11});
    }
    // One copy; per kept version the values that moved (each byte moves
    // with probability 1%: about 2% of the bf16 values) and a bit per
    // element (1/16 of a bf16 layer): 1 + 2 * (0.02 + 0.0625).
    EXPECT_LT(budget.in_use() / copy, 1.2) << "keep 2 once held 3 copies";
    EXPECT_GT(budget.in_use() / copy, 1.0);

    // A stream sends the newest: a publish goes into a new buffer, and the
    // old one goes when the stream lets go of it.
    std::optional<HeldLayer> sending = versions.WaitNewest(0, 6, absl::Now());
    bytes = Publish(*layout, bytes, 0.01, random);
    versions.Put(0, 7, true, bytes, {11});
    EXPECT_GT(budget.in_use() / copy, 2.0) << "copy on write";
    const std::optional<HeldLayer> pinned = versions.At(0, 6);
    ASSERT_TRUE(pinned.has_value());
    EXPECT_EQ(pinned->bytes, sending->bytes) << "a pinned read shares what the stream holds";
    const uint64_t both = budget.in_use();
    sending.reset();
    EXPECT_EQ(budget.in_use(), both) << "the pinned read still holds it";
  }
  EXPECT_EQ(budget.in_use(), 0u) << "everything held is given back";
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
