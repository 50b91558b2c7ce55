// ReadReshardedJournals: the pushes in the journals of N shards, cut to one
// shard of M's elements and put together; what only part of the set took
// is left out.

#include "server/training/journal_reshard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/server/checkpoints/checkpoint_test_util.h"

namespace layercast::server::testing {
namespace {

// One layer of two tensors, 5 and 3 elements: shard 0 of 2 owns elements
// [0, 2) and [0, 1), shard 1 of 2 [2, 5) and [1, 3).
ModelSpec TwoTensors() {
  return {.model_id = "journal-reshard",
          .layers = {{.name = "l0", .tensors = {{"a", {5}, 5}, {"b", {3}, 3}}}}};
}

layercast::v1::JournalIdentity Identity(uint32_t index, uint32_t count) {
  layercast::v1::JournalIdentity identity;
  identity.set_model_id("journal-reshard");
  identity.set_layout_digest("digest");
  identity.set_shard_index(index);
  identity.set_num_shards(count);
  return identity;
}

// Shard i of 2's slice of a push whose element k of tensor t is 10 t + k +
// 100 w.
std::vector<float> Slice(uint32_t shard, uint32_t worker) {
  const ModelSpec model = TwoTensors();
  std::vector<float> values;
  for (uint32_t t = 0; t < 2; ++t) {
    const ElementRange owned = ShardElementRange(model.layers[0].tensors[t].num_elements, shard, 2);
    for (uint64_t k = owned.begin; k < owned.end; ++k) {
      values.push_back(static_cast<float>(10 * t + k + 100 * worker));
    }
  }
  return values;
}

TEST(JournalReshardTest, PiecesArePutTogetherAndPartialPushesLeftOut) {
  const std::string dir = FreshDir("journals");
  for (uint32_t i = 0; i < 2; ++i) {
    auto journal = PushJournal::Open(dir, Identity(i, 2));
    ASSERT_TRUE(journal.ok()) << journal.status();
    ASSERT_TRUE((*journal)->AppendPush(0, 0, 7, Slice(i, 0)).ok());
    // Worker 1's push reached shard 0 only: never acknowledged by the set.
    if (i == 0) {
      ASSERT_TRUE((*journal)->AppendPush(0, 1, 7, Slice(i, 1)).ok());
    }
    ASSERT_TRUE((*journal)->AppendClipScale(7, 0.5f).ok());
  }
  auto read = ReadReshardedJournals(dir, Identity(0, 1), TwoTensors(), 2, {0, 1});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->read, 5u);
  EXPECT_EQ(read->incomplete, 1u);
  ASSERT_EQ(read->records.size(), 2u);
  EXPECT_EQ(read->records[0].kind, PushJournal::Record::Kind::kPush);
  EXPECT_EQ(read->records[0].worker, 0u);
  EXPECT_EQ(read->records[0].step, 7u);
  EXPECT_EQ(read->records[0].values, (std::vector<float>{0, 1, 2, 3, 4, 10, 11, 12}));
  EXPECT_EQ(read->records[1].kind, PushJournal::Record::Kind::kClipScale);
  EXPECT_EQ(read->records[1].values, std::vector<float>{0.5f});

  // Shard 0 of 3 owns [0, 1) of a (in shard 0 of 2) and [0, 1) of b (in
  // shard 0 of 2): only that journal holds its pieces, and worker 1's push
  // is whole there.
  read = ReadReshardedJournals(dir, Identity(0, 3), TwoTensors(), 2, {0});
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->incomplete, 0u);
  ASSERT_EQ(read->records.size(), 3u);
  EXPECT_EQ(read->records[1].worker, 1u);
  EXPECT_EQ(read->records[1].values, (std::vector<float>{100, 110}));
}

TEST(JournalReshardTest, AJournalOfAnotherModelRefuses) {
  const std::string dir = FreshDir("foreign");
  layercast::v1::JournalIdentity other = Identity(0, 2);
  other.set_model_id("another-model");
  {
    auto journal = PushJournal::Open(dir, other);
    ASSERT_TRUE(journal.ok());
    ASSERT_TRUE((*journal)->AppendPush(0, 0, 0, Slice(0, 0)).ok());
  }
  auto read = ReadReshardedJournals(dir, Identity(0, 1), TwoTensors(), 2, {0, 1});
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(read.status().message()), ::testing::HasSubstr("another-model"));
}

}  // namespace
}  // namespace layercast::server::testing
