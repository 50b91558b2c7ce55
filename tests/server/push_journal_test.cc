// The push journal on real files: records come back as written (bf16
// gradients in half the bytes), a record torn by a death ends only its own
// generation, a bad record with records after it is damage (refused, or
// accepted and set aside), a checkpoint's rotation retires what it holds,
// and a trainer that replays another's journal holds the same bits.

#include "server/push_journal.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/policy.h"
#include "core/synthetic_model.h"
#include "server/layer_trainer.h"
#include "server/parameter_store.h"

namespace layercast::server {
namespace {

using Record = PushJournal::Record;

std::string FreshDir(const std::string& name) {
  const auto dir = std::filesystem::path(::testing::TempDir()) /
                   ("push-journal-" + std::to_string(getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::unique_ptr<PushJournal> Open(const std::string& dir) {
  auto journal = PushJournal::Open(dir, 1, 2);
  EXPECT_TRUE(journal.ok()) << journal.status();
  return journal.ok() ? *std::move(journal) : nullptr;
}

std::vector<Record> ReplayAll(PushJournal& journal, PushJournal::Replayed* replayed = nullptr) {
  std::vector<Record> records;
  auto read = journal.Replay([&](Record record) {
    records.push_back(std::move(record));
    return absl::OkStatus();
  });
  EXPECT_TRUE(read.ok()) << read.status();
  if (replayed != nullptr && read.ok()) *replayed = *read;
  return records;
}

std::vector<std::string> Files(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(PushJournalTest, RecordsComeBackAsWrittenAndBf16GradientsTakeHalfTheBytes) {
  const std::string dir = FreshDir("records");
  const std::vector<float> wide = {1.0f / 3, -2.5e-7f, 1e30f};  // not bf16 values
  const std::vector<float> bf16 = {1.0f, -0.5f, 0.0f, std::bit_cast<float>(0x3f810000u)};
  {
    auto journal = Open(dir);
    ASSERT_TRUE(journal->AppendPush(3, 1, 7, wide).ok());
    EXPECT_EQ(journal->bytes(), 32u + 4 * wide.size() + 4);
    ASSERT_TRUE(journal->AppendPush(2, 0, 7, bf16).ok());
    EXPECT_EQ(journal->bytes(), 2 * 32u + 4 * wide.size() + 2 * bf16.size() + 2 * 4);
    ASSERT_TRUE(journal->AppendClipScale(7, 0.25f).ok());
  }
  EXPECT_THAT(Files(dir), ::testing::ElementsAre("shard-1-of-2.journal-0000000000000001"));
  auto reopened = Open(dir);
  const std::vector<Record> records = ReplayAll(*reopened);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0].kind, Record::Kind::kPush);
  EXPECT_EQ(records[0].layer, 3u);
  EXPECT_EQ(records[0].worker, 1u);
  EXPECT_EQ(records[0].step, 7u);
  EXPECT_EQ(records[0].values, wide);
  EXPECT_EQ(records[1].layer, 2u);
  EXPECT_EQ(records[1].values, bf16);
  EXPECT_EQ(records[2].kind, Record::Kind::kClipScale);
  EXPECT_EQ(records[2].values, std::vector<float>{0.25f});
}

TEST(PushJournalTest, ATornRecordEndsOnlyItsGenerationAndTheNextProcessWritesAnother) {
  const std::string dir = FreshDir("torn");
  {
    auto journal = Open(dir);
    ASSERT_TRUE(journal->AppendPush(0, 0, 0, std::vector<float>(100, 0.1f)).ok());
    ASSERT_TRUE(journal->AppendPush(0, 1, 0, std::vector<float>(100, 0.2f)).ok());
  }
  // A death in the middle of the second record's values.
  const std::string first = dir + "/shard-1-of-2.journal-0000000000000001";
  std::filesystem::resize_file(first, std::filesystem::file_size(first) - 150);
  {
    auto journal = Open(dir);
    ASSERT_TRUE(journal->AppendPush(1, 0, 0, std::vector<float>(10, 0.3f)).ok());
  }
  EXPECT_EQ(Files(dir).size(), 2u) << "a generation of the restarted process's own";
  auto reopened = Open(dir);
  PushJournal::Replayed replayed;
  const std::vector<Record> records = ReplayAll(*reopened, &replayed);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].values, std::vector<float>(100, 0.1f));
  EXPECT_EQ(records[1].values, std::vector<float>(10, 0.3f));
  EXPECT_EQ(replayed.torn_tails, 1u);

  // A flipped bit in its last whole record (nothing after it) is a torn
  // tail too: a machine that lost its page cache may leave such a record.
  const std::string second = dir + "/shard-1-of-2.journal-0000000000000002";
  std::fstream file(second, std::ios::in | std::ios::out | std::ios::binary);
  file.seekp(40);
  file.put('\x7f');
  file.close();
  auto damaged = Open(dir);
  replayed = {};
  EXPECT_EQ(ReplayAll(*damaged, &replayed).size(), 1u);
  EXPECT_EQ(replayed.torn_tails, 2u);
  EXPECT_FALSE(replayed.damage.has_value());
}

// Flips one bit at `offset` of `path`.
void FlipBit(const std::string& path, uint64_t offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(static_cast<std::streamoff>(offset));
  const char byte = static_cast<char>(file.get());
  file.seekp(static_cast<std::streamoff>(offset));
  file.put(static_cast<char>(byte ^ 0x10));
}

// Writes three generations of three pushes each (steps 0-8, 100 values
// each: records of 436 bytes); returns the first generation's path.
std::string WriteThreeGenerations(const std::string& dir) {
  for (uint64_t generation = 0; generation < 3; ++generation) {
    auto journal = Open(dir);
    for (uint64_t step = 3 * generation; step < 3 * generation + 3; ++step) {
      EXPECT_TRUE(
          journal->AppendPush(0, 0, step, std::vector<float>(100, 0.1f + static_cast<float>(step)))
              .ok());
    }
  }
  return dir + "/shard-1-of-2.journal-0000000000000001";
}

// A bad record with whole records after it lost acknowledged pushes: the
// replay refuses, naming the file, the offset and the last good step,
// wherever the flipped bit lands (values, step, count, magic).
TEST(PushJournalTest, ABadRecordWithRecordsAfterItIsDamageNotATornTail) {
  constexpr uint64_t kRecord = 32 + 400 + 4;
  for (const uint64_t at : {kRecord + 100, kRecord + 16, kRecord + 24, kRecord + 1}) {
    SCOPED_TRACE(at);
    const std::string dir = FreshDir("damage");
    const std::string first = WriteThreeGenerations(dir);
    FlipBit(first, at);
    auto journal = Open(dir);
    std::vector<Record> records;
    const auto read = journal->Replay([&](Record record) {
      records.push_back(std::move(record));
      return absl::OkStatus();
    });
    ASSERT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << read.status();
    EXPECT_THAT(std::string(read.status().message()),
                ::testing::AllOf(::testing::HasSubstr(first + " is damaged at byte 436"),
                                 ::testing::HasSubstr("last good step: step 0"),
                                 ::testing::HasSubstr("2 later generation(s)"),
                                 ::testing::HasSubstr("--accept-journal-damage")));
    EXPECT_EQ(records.size(), 1u);
    EXPECT_EQ(Files(dir).size(), 3u) << "a refused replay changes nothing on disk";
  }
}

// Accepted, the damage is set aside and the journal cut at it: the next
// replay (another start) sees exactly what this one did, then the pushes
// this process appends, with no flag.
TEST(PushJournalTest, AcceptedDamageIsSetAsideAndTheJournalEndsThere) {
  const std::string dir = FreshDir("accept");
  const std::string first = WriteThreeGenerations(dir);
  FlipBit(first, 436 + 50);  // the second push, step 1
  {
    auto journal = Open(dir);
    std::vector<Record> records;
    const auto read = journal->Replay(
        [&](Record record) {
          records.push_back(std::move(record));
          return absl::OkStatus();
        },
        PushJournal::OnDamage::kAccept);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE(read->damage.has_value());
    EXPECT_EQ(read->damage->path, first);
    EXPECT_EQ(read->damage->offset, 436u);
    EXPECT_EQ(read->damage->bytes_lost, 2 * 436u);
    EXPECT_EQ(read->damage->last_good_step, 0u);
    EXPECT_EQ(read->damage->later_generations, 2u);
    EXPECT_EQ(records.size(), 1u);
    EXPECT_EQ(journal->bytes(), 436u);
    ASSERT_TRUE(journal->AppendPush(0, 0, 1, std::vector<float>(100, 7.0f)).ok());
  }
  EXPECT_THAT(Files(dir),
              ::testing::ElementsAre("shard-1-of-2.journal-0000000000000001",
                                     "shard-1-of-2.journal-0000000000000001.damaged",
                                     "shard-1-of-2.journal-0000000000000002",
                                     "shard-1-of-2.journal-0000000000000002.after-damage",
                                     "shard-1-of-2.journal-0000000000000003.after-damage"));
  EXPECT_EQ(std::filesystem::file_size(first + ".damaged"), 3 * 436u);
  auto reopened = Open(dir);
  PushJournal::Replayed replayed;
  const std::vector<Record> records = ReplayAll(*reopened, &replayed);
  EXPECT_FALSE(replayed.damage.has_value());
  EXPECT_EQ(replayed.torn_tails, 0u);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].step, 0u);
  EXPECT_EQ(records[1].step, 1u);
  EXPECT_EQ(records[1].values, std::vector<float>(100, 7.0f));
}

// A torn tail whose cut-off values happen to hold no record is still torn,
// and so is garbage after a header cut short.
TEST(PushJournalTest, AShortTailOfGarbageIsTorn) {
  const std::string dir = FreshDir("garbage");
  {
    auto journal = Open(dir);
    ASSERT_TRUE(journal->AppendPush(0, 0, 0, std::vector<float>(100, 0.1f)).ok());
  }
  const std::string first = dir + "/shard-1-of-2.journal-0000000000000001";
  std::ofstream(first, std::ios::app | std::ios::binary) << std::string(20, '\xab');
  auto journal = Open(dir);
  PushJournal::Replayed replayed;
  EXPECT_EQ(ReplayAll(*journal, &replayed).size(), 1u);
  EXPECT_EQ(replayed.torn_tails, 1u);
  EXPECT_FALSE(replayed.damage.has_value());
}

TEST(PushJournalTest, ACheckpointRetiresTheGenerationsItHolds) {
  const std::string dir = FreshDir("rotate");
  auto journal = Open(dir);
  ASSERT_TRUE(journal->AppendPush(0, 0, 0, std::vector<float>(4, 1.0f)).ok());
  const uint64_t generation = journal->Rotate();
  ASSERT_TRUE(journal->AppendPush(0, 0, 1, std::vector<float>(4, 2.0f)).ok());
  journal->Retire(generation);
  EXPECT_THAT(Files(dir), ::testing::ElementsAre("shard-1-of-2.journal-0000000000000002"));
  EXPECT_EQ(journal->bytes(), 32u + 2 * 4 + 4);
  auto reopened = Open(dir);
  const std::vector<Record> records = ReplayAll(*reopened);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].step, 1u);
}

std::unique_ptr<ParameterStore> Store() {
  auto model = SyntheticModel::Create("llama:layers=2,hidden=32,ffn=48,vocab=40,seed=3");
  EXPECT_TRUE(model.ok()) << model.status();
  auto store = ParameterStore::Load(**model, 1, 2, *Policy::Parse("c=bf16"));
  EXPECT_TRUE(store.ok()) << store.status();
  return *std::move(store);
}

std::vector<uint32_t> MasterBits(const ParameterStore& store) {
  std::vector<uint32_t> bits;
  for (uint32_t l = 0; l < store.model().layers.size(); ++l) {
    for (uint32_t t = 0; t < store.model().layers[l].tensors.size(); ++t) {
      for (uint64_t i = 0; i < store.owned(l, t).size(); ++i) {
        bits.push_back(std::bit_cast<uint32_t>(store.master(l, t)[i]));
      }
    }
  }
  return bits;
}

TEST(PushJournalTest, ATrainerReplayingAnothersJournalHoldsTheSameBitsAndOpenSteps) {
  constexpr char kAdamW[] = "adamw:lr=1e-2,weight_decay=0.1,clip=1.0";
  const std::string dir = FreshDir("trainer");
  auto journal = Open(dir);
  auto store = Store();
  auto trainer = LayerTrainer::Create(*store, *OptimizerSpec::Parse(kAdamW), 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  (*trainer)->JournalTo(*journal);
  const auto layers = static_cast<uint32_t>(store->model().layers.size());
  std::mt19937 random(7);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  const auto push = [&](uint32_t l, uint32_t w, uint64_t step) {
    std::vector<float> g((*trainer)->owned_elements(l));
    for (float& v : g) v = normal(random);
    ASSERT_TRUE((*trainer)->Push(l, w, step, std::move(g)).ok());
  };
  for (uint64_t step = 0; step < 2; ++step) {
    for (uint32_t l = layers; l-- > 0;) {
      push(l, 1, step);
      push(l, 0, step);
    }
    ASSERT_TRUE((*trainer)->ApplyClippedStep(step, 0.5f).ok());
  }
  push(layers - 1, 1, 2);  // step 2 open: one push in

  auto restarted_store = Store();
  auto restarted = LayerTrainer::Create(*restarted_store, *OptimizerSpec::Parse(kAdamW), 2);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  auto reopened = Open(dir);
  absl::StatusOr<LayerTrainer::Replayed> replayed = (*restarted)->Replay(*reopened);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_EQ(replayed->taken, 2 * (2 * layers + 1) + 1);
  EXPECT_EQ(replayed->steps, 2 * layers);
  EXPECT_EQ(MasterBits(*restarted_store), MasterBits(*store));
  for (uint32_t l = 0; l < layers; ++l) {
    EXPECT_EQ((*restarted)->version(l), 2u);
    EXPECT_EQ((*restarted)->missing_workers(l), (*trainer)->missing_workers(l)) << "layer " << l;
  }
  EXPECT_EQ((*restarted)->NormOfStep(1).applied_scale, 0.5f);

  // Replayed again (a second restart before any checkpoint): nothing moves.
  replayed = (*restarted)->Replay(*reopened);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_EQ(replayed->taken, 0u);
  EXPECT_EQ(MasterBits(*restarted_store), MasterBits(*store));
}

}  // namespace
}  // namespace layercast::server
