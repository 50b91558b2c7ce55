// CastCache on its own: what a layer takes, its budget charged when taken
// and given back when the last holder lets go, the capacity and the room
// beside it, versions replacing one another, chunks claimed and found on
// the grid and off it.

#include "server/casting/cast_cache.h"

#include <gtest/gtest.h>
#include <boost/asio/thread_pool.hpp>

#include <cstring>
#include <optional>
#include <vector>

#include "core/crc32c.h"

namespace layercast::server {
namespace {

constexpr uint64_t kMaster = 1000;
constexpr uint64_t kChunkBytes = 64;  // 32 bfloat16 elements a chunk

// Layer 0: a bfloat16 tensor of 100 elements and a float32 one of 10;
// layer 1: an 8-bit float tensor only, which the cache never keeps.
std::vector<AssembledLayout> Layouts() {
  std::vector<AssembledLayout> layouts;
  layouts.push_back(*AssembledLayout::FromDTypes({DType::kBFloat16, DType::kFloat32}, {100, 10}));
  layouts.push_back(*AssembledLayout::FromDTypes({DType::kFloat8E4M3FN}, {256}));
  return layouts;
}

// On one shard of one, layer 0 takes 100 * 2 + 10 * 4 bytes.
constexpr uint64_t kLayer0 = 240;

struct Fixture {
  explicit Fixture(uint64_t capacity, std::optional<uint64_t> budget_bytes = std::nullopt)
      : budget(budget_bytes, kMaster, grants.get_executor()),
        cache({.capacity_bytes = capacity, .chunk_bytes = kChunkBytes}, layouts, budget, metrics) {}
  boost::asio::thread_pool grants{1};
  std::vector<AssembledLayout> layouts = Layouts();
  MemoryBudget budget;
  ServerMetrics metrics;
  CastCache cache;
};

ChunkKey Key(uint64_t version, uint64_t begin, uint64_t elements, uint32_t tensor = 0,
             DType dtype = DType::kBFloat16) {
  return {.layer = 0,
          .tensor = tensor,
          .element_begin = begin,
          .elements = elements,
          .version = version,
          .dtype = dtype};
}

// Claims chunk `key`, writes `fill` over it and fills it with that CRC.
void CastInto(CastCache::Layer& layer, const ChunkKey& key, uint8_t fill) {
  uint8_t* into = layer.Claim(key);
  ASSERT_NE(into, nullptr);
  const size_t bytes = key.elements * DTypeSize(key.dtype);
  std::memset(into, fill, bytes);
  const CastChunk chunk = layer.Fill(key, Crc32c(into, bytes));
  EXPECT_EQ(chunk.data.size(), bytes);
  EXPECT_EQ(chunk.data.begin(), into) << "a slice of the cache, not a copy";
}

TEST(CastCacheTest, ALayerIsChargedWhileHeldAndGivenBackByItsLastHolder) {
  EXPECT_EQ(CastCache::LayerBytes(Layouts()[0], 0, 1), kLayer0);
  EXPECT_EQ(CastCache::LayerBytes(Layouts()[0], 1, 2), 50 * 2 + 5 * 4);
  EXPECT_EQ(CastCache::LayerBytes(Layouts()[1], 0, 1), 0u) << "8-bit floats are not kept";
  Fixture f(1 << 20);
  EXPECT_EQ(f.cache.ForVersion(1, 0), nullptr);
  std::shared_ptr<CastCache::Layer> layer = f.cache.ForVersion(0, 3);
  ASSERT_NE(layer, nullptr);
  EXPECT_EQ(f.cache.ForVersion(0, 3), layer) << "one layer per version, shared";
  EXPECT_EQ(f.budget.in_use(), kMaster + kLayer0);
  EXPECT_EQ(f.cache.held_bytes(), kLayer0);
  EXPECT_EQ(f.metrics.cast_cache_bytes().Value(), kLayer0);
  EXPECT_EQ(f.metrics.cast_cache_layers().Value(), 1);

  CastInto(*layer, Key(3, 0, 32), 7);
  std::optional<CastChunk> sent = layer->Find(Key(3, 0, 32));
  ASSERT_TRUE(sent.has_value());
  f.cache.DropAll();
  EXPECT_EQ(f.cache.held_bytes(), 0u);
  EXPECT_EQ(f.metrics.cast_cache_bytes().Value(), 0);
  layer.reset();
  EXPECT_EQ(f.budget.in_use(), kMaster + kLayer0) << "a slice in flight still holds the layer";
  EXPECT_EQ(sent->data.begin()[31], 7);
  sent.reset();
  EXPECT_EQ(f.budget.in_use(), kMaster);
}

TEST(CastCacheTest, ANewerVersionReplacesTheLayerAndAnOlderOneIsNotKept) {
  Fixture f(1 << 20);
  std::shared_ptr<CastCache::Layer> v1 = f.cache.ForVersion(0, 1);
  ASSERT_NE(v1, nullptr);
  CastInto(*v1, Key(1, 0, 32), 1);
  std::shared_ptr<CastCache::Layer> v2 = f.cache.ForVersion(0, 2);
  ASSERT_NE(v2, nullptr);
  EXPECT_NE(v2, v1);
  EXPECT_EQ(f.cache.held_bytes(), kLayer0) << "the cache holds one version of a layer";
  EXPECT_EQ(f.budget.in_use(), kMaster + 2 * kLayer0) << "the old one, while a stream holds it";
  EXPECT_FALSE(v2->Find(Key(2, 0, 32)).has_value()) << "nothing of version 1 is served for 2";
  EXPECT_FALSE(v1->Find(Key(2, 0, 32)).has_value()) << "a layer serves its own version only";
  EXPECT_TRUE(v1->Find(Key(1, 0, 32)).has_value()) << "its stream still sends what it holds";
  EXPECT_EQ(f.cache.ForVersion(0, 1), nullptr) << "a pinned read of version 1 casts as before";
  v1.reset();
  EXPECT_EQ(f.budget.in_use(), kMaster + kLayer0);
}

TEST(CastCacheTest, ALayerIsTakenOnlyWithinTheCapacityAndWithRoomBesideIt) {
  {
    Fixture f(kLayer0 - 1);
    EXPECT_EQ(f.cache.ForVersion(0, 0), nullptr) << "over the capacity";
    EXPECT_EQ(f.budget.in_use(), kMaster);
  }
  {
    // As much room again beside it: 2 * 240 bytes beside the master.
    Fixture f(1 << 20, kMaster + 2 * kLayer0 - 1);
    EXPECT_EQ(f.cache.ForVersion(0, 0), nullptr) << "the budget leaves no room beside it";
    EXPECT_EQ(f.budget.in_use(), kMaster);
  }
  {
    Fixture f(1 << 20, kMaster + 2 * kLayer0);
    EXPECT_NE(f.cache.ForVersion(0, 0), nullptr);
    EXPECT_EQ(f.budget.in_use(), kMaster + kLayer0);
  }
  EXPECT_TRUE(CastCache::Admits(0, 10, 10, std::nullopt, 0));
  EXPECT_FALSE(CastCache::Admits(1, 10, 10, std::nullopt, 0)) << "held counts";
  EXPECT_FALSE(CastCache::Admits(0, 0, 10, std::nullopt, 0)) << "nothing to keep";
  EXPECT_FALSE(CastCache::Admits(0, 10, 100, 105, 90)) << "15 free, 20 wanted";
  EXPECT_FALSE(CastCache::Admits(0, 10, 100, 90, 95)) << "over the budget already";
}

TEST(CastCacheTest, ChunksAreClaimedOnceOnTheGridAndFoundWhenEveryPartIsFilled) {
  Fixture f(1 << 20);
  std::shared_ptr<CastCache::Layer> layer = f.cache.ForVersion(0, 0);
  ASSERT_NE(layer, nullptr);
  EXPECT_EQ(layer->Claim(Key(0, 1, 32)), nullptr) << "off the grid";
  EXPECT_EQ(layer->Claim(Key(0, 0, 16)), nullptr) << "part of a chunk";
  EXPECT_EQ(layer->Claim(Key(0, 0, 32, 0, DType::kFloat16)), nullptr) << "another dtype";
  EXPECT_EQ(layer->Claim(Key(0, 96, 8)), nullptr) << "past the owned elements";
  uint8_t* first = layer->Claim(Key(0, 0, 32));
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(layer->Claim(Key(0, 0, 32)), nullptr) << "claimed already";
  layer->Abandon(Key(0, 0, 32));
  EXPECT_FALSE(layer->Find(Key(0, 0, 32)).has_value()) << "an abandoned cast is not served";
  CastInto(*layer, Key(0, 0, 32), 1);
  CastInto(*layer, Key(0, 32, 32), 2);
  CastInto(*layer, Key(0, 96, 4), 4);  // the tensor's last, shorter chunk
  CastInto(*layer, Key(0, 0, 10, 1, DType::kFloat32), 9);

  const std::optional<CastChunk> whole = layer->Find(Key(0, 32, 32));
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->crc32c, Crc32c(whole->data.begin(), 64));
  // Elements [16, 48): half of each of the first two chunks, its CRC its own.
  const std::optional<CastChunk> straddling = layer->Find(Key(0, 16, 32));
  ASSERT_TRUE(straddling.has_value());
  EXPECT_EQ(straddling->data.begin()[0], 1);
  EXPECT_EQ(straddling->data.begin()[63], 2);
  EXPECT_EQ(straddling->crc32c, Crc32c(straddling->data.begin(), 64));
  EXPECT_FALSE(layer->Find(Key(0, 40, 40)).has_value()) << "elements [64, 96) are not cast yet";
  const std::optional<CastChunk> f32 = layer->Find(Key(0, 0, 10, 1, DType::kFloat32));
  ASSERT_TRUE(f32.has_value());
  EXPECT_EQ(f32->data.size(), 40u);
  EXPECT_EQ(f32->data.begin()[39], 9);
}

}  // namespace
}  // namespace layercast::server
