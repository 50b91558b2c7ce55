// CastErrorLedger on its own: a chunk is measured once per version, a newer
// version replaces an older one and never the other way round, a layer's
// summary adds up its chunks at the newest version only, and a chunk's CRC
// is kept with its figures at their version.

#include "server/casting/cast_error_ledger.h"

#include <gtest/gtest.h>
#include <malloc.h>

#include <vector>

namespace layercast::server {
namespace {

// Room for every chunk and layer the tests below record.
constexpr uint64_t kGridChunks = 64;
constexpr uint32_t kLayers = 8;

ChunkKey Key(uint32_t layer, uint64_t begin, uint64_t version, DType dtype = DType::kBFloat16) {
  return ChunkKey{.layer = layer,
                  .tensor = 0,
                  .element_begin = begin,
                  .elements = 100,
                  .version = version,
                  .dtype = dtype};
}

CastError Lost(uint64_t flushed, float max) {
  CastError error;
  error.elements = 100;
  error.measured = 100;
  error.flushed_to_zero = flushed;
  error.max_relative_error = max;
  error.relative_error_sum = max * 10;
  return error;
}

TEST(CastErrorLedgerTest, AChunkIsKnownAtTheVersionItWasMeasuredAt) {
  CastErrorLedger ledger(kGridChunks, kLayers);
  EXPECT_FALSE(ledger.Find(Key(0, 0, 3)).has_value());
  EXPECT_TRUE(ledger.Record(Key(0, 0, 3), Lost(2, 0.5f)));
  ASSERT_TRUE(ledger.Find(Key(0, 0, 3)).has_value());
  EXPECT_EQ(ledger.Find(Key(0, 0, 3))->error.flushed_to_zero, 2u);
  // Other versions, ranges, dtypes and layers are other chunks.
  EXPECT_FALSE(ledger.Find(Key(0, 0, 4)).has_value());
  EXPECT_FALSE(ledger.Find(Key(0, 100, 3)).has_value());
  EXPECT_FALSE(ledger.Find(Key(0, 0, 3, DType::kFloat16)).has_value());
  EXPECT_FALSE(ledger.Find(Key(1, 0, 3)).has_value());
  // A delta's values are those of its version.
  ChunkKey delta = Key(0, 0, 3);
  delta.base_version = 1;
  EXPECT_TRUE(ledger.Find(delta).has_value());
}

TEST(CastErrorLedgerTest, RecordsEachChunkAndVersionOnceAndNeverGoesBack) {
  CastErrorLedger ledger(kGridChunks, kLayers);
  EXPECT_TRUE(ledger.Record(Key(0, 0, 3), Lost(2, 0.5f)));
  EXPECT_FALSE(ledger.Record(Key(0, 0, 3), Lost(2, 0.5f))) << "measured twice at once";
  EXPECT_TRUE(ledger.Record(Key(0, 0, 5), Lost(7, 0.25f)));
  EXPECT_FALSE(ledger.Record(Key(0, 0, 4), Lost(9, 1))) << "a pinned reader's older version";
  EXPECT_FALSE(ledger.Find(Key(0, 0, 3)).has_value());
  ASSERT_TRUE(ledger.Find(Key(0, 0, 5)).has_value());
  EXPECT_EQ(ledger.Find(Key(0, 0, 5))->error.flushed_to_zero, 7u);
}

TEST(CastErrorLedgerTest, KeepsAWholeChunksCrcAtItsVersionOnly) {
  CastErrorLedger ledger(kGridChunks, kLayers);
  // A delta measures a chunk's values without the whole chunk's bytes.
  ASSERT_TRUE(ledger.Record(Key(0, 0, 3), Lost(0, 0.5f)));
  EXPECT_FALSE(ledger.Find(Key(0, 0, 3))->crc32c.has_value());
  // The first whole cast after it brings the CRC; the figures stay.
  EXPECT_FALSE(ledger.Record(Key(0, 0, 3), Lost(9, 1), 0xC0FFEEu));
  ASSERT_TRUE(ledger.Find(Key(0, 0, 3))->crc32c.has_value());
  EXPECT_EQ(*ledger.Find(Key(0, 0, 3))->crc32c, 0xC0FFEEu);
  EXPECT_EQ(ledger.Find(Key(0, 0, 3))->error.flushed_to_zero, 0u);
  // Kept once: a later record at the same version changes nothing.
  EXPECT_FALSE(ledger.Record(Key(0, 0, 3), Lost(0, 0.5f), 0xBADu));
  EXPECT_EQ(*ledger.Find(Key(0, 0, 3))->crc32c, 0xC0FFEEu);
  // An older version's CRC never lands on a newer version's figures, and a
  // newer version starts without the older one's.
  ASSERT_TRUE(ledger.Record(Key(0, 100, 5), Lost(0, 0.5f)));
  EXPECT_FALSE(ledger.Record(Key(0, 100, 4), Lost(0, 0.5f), 0xBADu));
  EXPECT_FALSE(ledger.Find(Key(0, 100, 5))->crc32c.has_value());
  EXPECT_TRUE(ledger.Record(Key(0, 0, 4), Lost(0, 0.25f)));
  EXPECT_FALSE(ledger.Find(Key(0, 0, 4))->crc32c.has_value());
  EXPECT_TRUE(ledger.Record(Key(0, 200, 1), Lost(0, 0.25f), 7u));
  EXPECT_EQ(*ledger.Find(Key(0, 200, 1))->crc32c, 7u);
}

TEST(CastErrorLedgerTest, ReplacesAKeptCrcAtItsVersionOnly) {
  CastErrorLedger ledger(kGridChunks, kLayers);
  EXPECT_FALSE(ledger.ReplaceCrc(Key(0, 0, 3), 1u)) << "nothing kept";
  EXPECT_FALSE(ledger.Find(Key(0, 0, 3)).has_value());
  ASSERT_TRUE(ledger.Record(Key(0, 0, 3), Lost(2, 0.5f), 0xBADu));
  EXPECT_FALSE(ledger.ReplaceCrc(Key(0, 0, 3), 0xBADu)) << "the same CRC";
  EXPECT_TRUE(ledger.ReplaceCrc(Key(0, 0, 3), 0xC0FFEEu));
  EXPECT_EQ(*ledger.Find(Key(0, 0, 3))->crc32c, 0xC0FFEEu);
  EXPECT_EQ(ledger.Find(Key(0, 0, 3))->error.flushed_to_zero, 2u) << "the figures stay";
  // Another version's CRC never replaces this one's.
  EXPECT_FALSE(ledger.ReplaceCrc(Key(0, 0, 2), 7u));
  EXPECT_FALSE(ledger.ReplaceCrc(Key(0, 0, 4), 7u));
  EXPECT_EQ(*ledger.Find(Key(0, 0, 3))->crc32c, 0xC0FFEEu);
  // A chunk a delta measured, with no CRC yet, takes the one given.
  ASSERT_TRUE(ledger.Record(Key(0, 100, 3), Lost(0, 0.5f)));
  EXPECT_FALSE(ledger.ReplaceCrc(Key(0, 100, 3), 9u));
  EXPECT_EQ(*ledger.Find(Key(0, 100, 3))->crc32c, 9u);
}

TEST(CastErrorLedgerTest, SummarizesEachLayerAndDtypeAtItsNewestVersion) {
  CastErrorLedger ledger(kGridChunks, kLayers);
  ASSERT_TRUE(ledger.Record(Key(2, 0, 5), Lost(1, 0.125f)));
  ASSERT_TRUE(ledger.Record(Key(2, 100, 5), Lost(2, 0.5f)));
  ASSERT_TRUE(ledger.Record(Key(2, 200, 4), Lost(40, 1)));  // not cast at 5 yet
  ASSERT_TRUE(ledger.Record(Key(2, 0, 5, DType::kFloat16), Lost(3, 0.25f)));
  ASSERT_TRUE(ledger.Record(Key(0, 0, 1), Lost(0, 0.0625f)));
  ASSERT_TRUE(ledger.Record(Key(1, 0, 1, DType::kFloat32), CastError(), 7u));  // CRC only

  const std::vector<CastErrorLedger::LayerSummary> summary = ledger.Summarize();
  ASSERT_EQ(summary.size(), 3u);
  EXPECT_EQ(summary[0].layer, 0u);
  EXPECT_EQ(summary[0].version, 1u);
  EXPECT_EQ(summary[0].chunks, 1u);

  EXPECT_EQ(summary[1].layer, 2u);
  EXPECT_EQ(summary[1].dtype, DType::kBFloat16);
  EXPECT_EQ(summary[1].version, 5u);
  EXPECT_EQ(summary[1].chunks, 2u);
  EXPECT_EQ(summary[1].error.elements, 200u);
  EXPECT_EQ(summary[1].error.flushed_to_zero, 3u);
  EXPECT_EQ(summary[1].error.max_relative_error, 0.5f);
  EXPECT_DOUBLE_EQ(summary[1].error.relative_error_sum, 6.25);

  EXPECT_EQ(summary[2].layer, 2u);
  EXPECT_EQ(summary[2].dtype, DType::kFloat16);
  EXPECT_EQ(summary[2].error.flushed_to_zero, 3u);
}

// The summaries kept as chunks come give what a walk over the chunks gave:
// a chunk moving to a newer version leaves the older figures behind, and
// one recorded late at an older version is kept for its own casts but not
// summed.
TEST(CastErrorLedgerTest, ASummaryFollowsItsLayersNewestVersion) {
  CastErrorLedger ledger(kGridChunks, kLayers);
  ASSERT_TRUE(ledger.Record(Key(3, 0, 1), Lost(1, 0.25f)));
  ASSERT_TRUE(ledger.Record(Key(3, 100, 1), Lost(2, 0.125f)));
  ASSERT_TRUE(ledger.Record(Key(3, 0, 2), Lost(4, 0.0625f)));  // chunk 0 moves on
  ASSERT_TRUE(ledger.Record(Key(3, 200, 1), Lost(8, 1)));      // late, at version 1
  std::vector<CastErrorLedger::LayerSummary> summary = ledger.Summarize();
  ASSERT_EQ(summary.size(), 1u);
  EXPECT_EQ(summary[0].version, 2u);
  EXPECT_EQ(summary[0].chunks, 1u);
  EXPECT_EQ(summary[0].error.flushed_to_zero, 4u);
  EXPECT_EQ(summary[0].error.max_relative_error, 0.0625f);
  EXPECT_TRUE(ledger.Find(Key(3, 200, 1)).has_value());

  ASSERT_TRUE(ledger.Record(Key(3, 100, 2), Lost(16, 0.5f)));
  summary = ledger.Summarize();
  ASSERT_EQ(summary.size(), 1u);
  EXPECT_EQ(summary[0].chunks, 2u);
  EXPECT_EQ(summary[0].error.flushed_to_zero, 20u);
  EXPECT_EQ(summary[0].error.max_relative_error, 0.5f);
}

// A layer the ledger was not made for is refused, as a chunk beyond its
// grid is: nothing is kept for it and no summary grows.
TEST(CastErrorLedgerTest, RefusesALayerBeyondItsModel) {
  CastErrorLedger ledger(kGridChunks, kLayers);
  EXPECT_FALSE(ledger.Record(Key(kLayers, 0, 1), Lost(1, 0.5f)));
  EXPECT_FALSE(ledger.Find(Key(kLayers, 0, 1)).has_value());
  EXPECT_TRUE(ledger.Summarize().empty());
  EXPECT_TRUE(ledger.Record(Key(kLayers - 1, 0, 1), Lost(1, 0.5f)));
}

// A shard whose grid has more chunks than the 65536 an earlier ledger kept
// before it forgot them all (and measured and counted them again): every
// chunk stays known, and one beyond the grid it was made for is refused
// without displacing any.
TEST(CastErrorLedgerTest, KeepsEveryChunkOfTheGridItWasMadeFor) {
  constexpr uint64_t kChunks = 100'000;
  CastErrorLedger ledger(kChunks, kLayers);
  for (uint64_t i = 0; i < kChunks; ++i) {
    ASSERT_TRUE(ledger.Record(Key(static_cast<uint32_t>(i % 7), i * 100, 1), Lost(0, 0))) << i;
  }
  EXPECT_FALSE(ledger.Record(Key(7, 0, 1), Lost(0, 0)));
  EXPECT_FALSE(ledger.Find(Key(7, 0, 1)).has_value());
  // A known chunk at a newer version still takes its slot's place.
  EXPECT_TRUE(ledger.Record(Key(0, 0, 2), Lost(1, 0.5f)));
  uint64_t chunks = 0;
  for (const CastErrorLedger::LayerSummary& layer : ledger.Summarize()) chunks += layer.chunks;
  EXPECT_EQ(chunks, kChunks - (kChunks + 6) / 7 + 1) << "layer 0 is summarised at version 2 only";
  for (uint64_t i = 0; i < kChunks; i += 997) {
    EXPECT_TRUE(ledger.Find(Key(static_cast<uint32_t>(i % 7), i * 100, i == 0 ? 2 : 1)))
        << "chunk " << i << " was forgotten";
  }
}

// Bytes glibc's heap hands out: small blocks and mmapped large ones.
size_t HeapBytes() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}

// Whether HeapBytes sees this process's allocations (not under a
// sanitizer's allocator).
bool HeapBytesSeesTheHeap() {
  const size_t before = HeapBytes();
  const std::vector<char> probe(1 << 16, 1);
  return HeapBytes() - before >= probe.size();
}

// What the memory plan counts for the ledger covers what its table and its
// layers' summaries take from the heap once the whole grid is recorded.
TEST(CastErrorLedgerTest, HoldsNoMoreThanBytesForSays) {
  if (!HeapBytesSeesTheHeap()) GTEST_SKIP() << "mallinfo2 does not see this heap";
  // Tables from 21 KiB up: glibc's thread cache keeps small freed blocks
  // counted as in use, so a small table's growth cannot be told apart.
  for (uint64_t chunks : {uint64_t{100}, uint64_t{4097}, uint64_t{70'000}}) {
    const size_t before = HeapBytes();
    CastErrorLedger ledger(chunks, 1);
    for (uint64_t i = 0; i < chunks; ++i) {
      ASSERT_TRUE(ledger.Record(Key(0, i * 100, 1), Lost(0, 0)));
    }
    const size_t held = HeapBytes() - before;
    EXPECT_LE(held, CastErrorLedger::BytesFor(chunks, 1)) << chunks << " chunks";
    EXPECT_GE(held * 4, CastErrorLedger::BytesFor(chunks, 1))
        << chunks << " chunks: the plan counts far more than the table holds";
  }
  EXPECT_EQ(CastErrorLedger::BytesFor(uint64_t{1} << 50, 1), UINT64_MAX);
}

// Many layers and one chunk: the layers' summaries are what it holds, in
// one block malloc maps on its own (whole pages) or carves from its heap,
// whichever its threshold, which earlier frees move, says.
TEST(CastErrorLedgerTest, HoldsNoMoreThanBytesForSaysForManyLayers) {
  if (!HeapBytesSeesTheHeap()) GTEST_SKIP() << "mallinfo2 does not see this heap";
  constexpr uint32_t kManyLayers = 20'000;
  const size_t before = HeapBytes();
  CastErrorLedger ledger(1, kManyLayers);
  ASSERT_TRUE(ledger.Record(Key(kManyLayers - 1, 0, 1), Lost(0, 0)));
  const size_t held = HeapBytes() - before;
  EXPECT_LE(held, CastErrorLedger::BytesFor(1, kManyLayers));
  EXPECT_GE(held * 2, CastErrorLedger::BytesFor(1, kManyLayers))
      << "the plan counts far more than the summaries hold";
}

}  // namespace
}  // namespace layercast::server
