// The push journal on real files: records come back as written (bf16
// gradients in half the bytes), a record torn by a death ends only its own
// generation, a bad record with records after it is damage (refused, or
// accepted and set aside), a checkpoint's rotation retires what it holds,
// and a trainer that replays another's journal holds the same bits. Each
// sync policy: every-push syncs before an append returns, grouped appends
// share one sync at most an interval after they were written (group
// commit, on a ManualClock), and a failed sync breaks the journal.

#include "server/training/push_journal.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "core/policy.h"
#include "core/synthetic_model.h"
#include "platform/clock.h"
#include "server/serving/parameter_store.h"
#include "server/training/layer_trainer.h"

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

// Flips one bit at `offset` of `path`.
void FlipBit(const std::string& path, uint64_t offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(static_cast<std::streamoff>(offset));
  const char byte = static_cast<char>(file.get());
  file.seekp(static_cast<std::streamoff>(offset));
  file.put(static_cast<char>(byte ^ 0x10));
}

// A bf16 layer with a float32 tensor in it (a norm): only the blocks of
// 4096 values holding a float32 value take four bytes a value.
std::vector<float> MostlyBf16(uint64_t step) {
  std::vector<float> values(3 * 4096 + 100);
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = std::bit_cast<float>(0x3f800000u + (static_cast<uint32_t>(i + step) << 16));
  }
  values[4096 + 5] = 1.0f / 3;  // block 1 only
  return values;
}
constexpr uint64_t kMostlyBf16Bytes = 32 + 8 + 1 + 2 * (3 * 4096 + 100) + 2 * 4096 + 4;

TEST(PushJournalTest, ALayerWithSomeFloat32ValuesKeepsTheRestAsBf16) {
  const std::string dir = FreshDir("mixed");
  {
    auto journal = Open(dir);
    ASSERT_TRUE(journal->AppendPush(1, 0, 3, MostlyBf16(3)).ok());
    EXPECT_EQ(journal->bytes(), kMostlyBf16Bytes);
    ASSERT_TRUE(journal->AppendPush(1, 1, 3, MostlyBf16(4)).ok());
  }
  auto reopened = Open(dir);
  std::vector<Record> records = ReplayAll(*reopened);
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].values, MostlyBf16(3));
  EXPECT_EQ(records[1].values, MostlyBf16(4));
  EXPECT_EQ(records[1].worker, 1u);

  // A flipped bit in its prefix (the count of float32 values) or its
  // bitmap, with a record after it, is damage.
  const std::string file = dir + "/shard-1-of-2.journal-0000000000000001";
  for (const uint64_t at : {32u, 40u}) {
    FlipBit(file, at);
    auto damaged = Open(dir);
    const auto read = damaged->Replay([](Record) { return absl::OkStatus(); });
    EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << at;
    EXPECT_THAT(std::string(read.status().message()), ::testing::HasSubstr("damaged at byte 0"));
    FlipBit(file, at);
  }
  // Cut inside the second one: a torn tail.
  std::filesystem::resize_file(file, kMostlyBf16Bytes + 100);
  PushJournal::Replayed replayed;
  records = ReplayAll(*Open(dir), &replayed);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].values, MostlyBf16(3));
  EXPECT_EQ(replayed.torn_tails, 1u);
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
  (*trainer)->checkpoint().JournalTo(*journal);
  const auto layers = static_cast<uint32_t>(store->model().layers.size());
  std::mt19937 random(7);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  // As a push stream does (no budget linked: its staging is reserved at once).
  const auto push = [&](uint32_t l, uint32_t w, uint64_t step) {
    absl::StatusOr<LayerTrainer::PushTicket> ticket = (*trainer)->AdmitPush(l, w, step);
    ASSERT_TRUE(ticket.ok()) << ticket.status();
    ASSERT_EQ(ticket->Reserve(std::chrono::steady_clock::time_point::max(), [](bool) {}), 0u);
    absl::StatusOr<std::span<float>> g = ticket->Stage();
    ASSERT_TRUE(g.ok()) << g.status();
    for (float& v : *g) v = normal(random);
    ASSERT_TRUE(ticket->Push().ok());
  };
  for (uint64_t step = 0; step < 2; ++step) {
    for (uint32_t l = layers; l-- > 0;) {
      push(l, 1, step);
      push(l, 0, step);
    }
    ASSERT_TRUE((*trainer)->clip().ApplyClippedStep(step, 0.5f).ok());
  }
  push(layers - 1, 1, 2);  // step 2 open: one push in

  auto restarted_store = Store();
  auto restarted = LayerTrainer::Create(*restarted_store, *OptimizerSpec::Parse(kAdamW), 2);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  auto reopened = Open(dir);
  absl::StatusOr<LayerTrainer::Replayed> replayed = (*restarted)->checkpoint().Replay(*reopened);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_EQ(replayed->taken, 2 * (2 * layers + 1) + 1);
  EXPECT_EQ(replayed->steps, 2 * layers);
  EXPECT_EQ(MasterBits(*restarted_store), MasterBits(*store));
  for (uint32_t l = 0; l < layers; ++l) {
    EXPECT_EQ((*restarted)->layers().version(l), 2u);
    EXPECT_EQ((*restarted)->layers().missing_workers(l), (*trainer)->layers().missing_workers(l))
        << "layer " << l;
  }
  EXPECT_EQ((*restarted)->clip().NormOfStep(1).applied_scale, 0.5f);

  // Replayed again (a second restart before any checkpoint): nothing moves.
  replayed = (*restarted)->checkpoint().Replay(*reopened);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_EQ(replayed->taken, 0u);
  EXPECT_EQ(MasterBits(*restarted_store), MasterBits(*store));
}

// The real file system, counting what the journal's files are told: bytes
// appended, bytes as of the last sync, syncs; a sync fails while
// `fail_syncs` is set. Thread-safe (the test reads while appends run).
class SyncLedgerFileSystem final : public FileSystem {
 public:
  struct Counts {
    uint64_t appended = 0, synced = 0, syncs = 0, dir_syncs = 0;
  };
  Counts counts() const {
    absl::MutexLock lock(&mu_);
    return counts_;
  }
  void set_fail_syncs(bool fail) {
    absl::MutexLock lock(&mu_);
    fail_syncs_ = fail;
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    return DefaultFileSystem().OpenForRead(path);
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const std::string& path) override {
    absl::StatusOr<std::unique_ptr<WritableFile>> file = DefaultFileSystem().OpenForWrite(path);
    if (!file.ok()) return file.status();
    return std::unique_ptr<WritableFile>(new File(*this, *std::move(file)));
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> CreatePrivate(const std::string& path) override {
    return DefaultFileSystem().CreatePrivate(path);
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    return DefaultFileSystem().Rename(from, to);
  }
  absl::Status SyncDir(const std::string& dir) override {
    absl::MutexLock lock(&mu_);
    ++counts_.dir_syncs;
    return DefaultFileSystem().SyncDir(dir);
  }
  absl::Status Remove(const std::string& path) override { return DefaultFileSystem().Remove(path); }
  bool Exists(const std::string& path) override { return DefaultFileSystem().Exists(path); }

 private:
  class File final : public WritableFile {
   public:
    File(SyncLedgerFileSystem& fs, std::unique_ptr<WritableFile> file)
        : fs_(fs), file_(std::move(file)) {}
    absl::Status Append(std::span<const uint8_t> data) override {
      absl::MutexLock lock(&fs_.mu_);
      fs_.counts_.appended += data.size();
      return file_->Append(data);
    }
    absl::Status Sync() override {
      absl::MutexLock lock(&fs_.mu_);
      if (fs_.fail_syncs_) return absl::DataLossError("fsync of a test file: input/output error");
      ++fs_.counts_.syncs;
      fs_.counts_.synced = fs_.counts_.appended;
      return file_->Sync();
    }
    absl::Status Close() override { return file_->Close(); }

   private:
    SyncLedgerFileSystem& fs_;
    std::unique_ptr<WritableFile> file_;
  };

  mutable absl::Mutex mu_;
  Counts counts_ ABSL_GUARDED_BY(mu_);
  bool fail_syncs_ ABSL_GUARDED_BY(mu_) = false;
};

std::unique_ptr<PushJournal> OpenSyncing(const std::string& dir, FileSystem& fs,
                                         PushJournal::Durability durability) {
  auto journal = PushJournal::Open(dir, 1, 2, fs, durability);
  EXPECT_TRUE(journal.ok()) << journal.status();
  return journal.ok() ? *std::move(journal) : nullptr;
}

TEST(PushJournalSyncTest, NoneNeverSyncsAndEveryPushSyncsBeforeAnAppendReturns) {
  SyncLedgerFileSystem fs;
  {
    auto journal = OpenSyncing(FreshDir("sync-none"), fs, {});
    ASSERT_TRUE(journal->AppendPush(0, 0, 0, std::vector<float>(100, 0.1f)).ok());
    EXPECT_EQ(fs.counts().syncs, 0u);
    EXPECT_EQ(fs.counts().dir_syncs, 0u);
  }
  auto journal = OpenSyncing(FreshDir("sync-every"), fs, {.sync = PushJournal::Sync::kEveryPush});
  for (uint64_t step = 0; step < 3; ++step) {
    ASSERT_TRUE(journal->AppendPush(0, 0, step, std::vector<float>(100, 0.1f)).ok());
    const SyncLedgerFileSystem::Counts counts = fs.counts();
    EXPECT_EQ(counts.synced, counts.appended) << "step " << step << ": answered before its sync";
    EXPECT_EQ(counts.syncs, step + 1);
  }
  ASSERT_TRUE(journal->AppendClipScale(2, 0.5f).ok());
  EXPECT_EQ(fs.counts().synced, fs.counts().appended) << "a clip scale is synced too";
  EXPECT_EQ(fs.counts().dir_syncs, 1u) << "the new generation's name, once";
}

TEST(PushJournalSyncTest, GroupedAppendsShareOneSyncAtMostAnIntervalAfterTheyWereWritten) {
  SyncLedgerFileSystem fs;
  platform::ManualClock clock;
  constexpr auto kInterval = std::chrono::milliseconds(10);
  auto journal =
      OpenSyncing(FreshDir("sync-grouped"), fs,
                  {.sync = PushJournal::Sync::kGrouped, .interval = kInterval, .clock = &clock});
  // The first sync has no interval to wait for.
  ASSERT_TRUE(journal->AppendPush(0, 0, 0, std::vector<float>(100, 0.1f)).ok());
  ASSERT_EQ(fs.counts().syncs, 1u);
  const uint64_t one_record = journal->bytes();

  // Three concurrent pushes within the interval of that sync: written at
  // once, answered together after one more sync, when the interval is up.
  constexpr int kPushes = 3;
  std::atomic<int> answered = 0;
  std::vector<std::thread> pushes;
  for (uint32_t l = 1; l <= kPushes; ++l) {
    pushes.emplace_back([&, l] {
      EXPECT_TRUE(journal->AppendPush(l, 0, 0, std::vector<float>(100, 0.1f)).ok());
      const SyncLedgerFileSystem::Counts counts = fs.counts();
      EXPECT_EQ(counts.synced, counts.appended) << "layer " << l << ": answered before its sync";
      ++answered;
    });
  }
  while (journal->bytes() < (kPushes + 1) * one_record) std::this_thread::yield();
  // Nothing the correct code could do makes these pass late: a wrong one
  // that answers early is caught (most of the time within this pause).
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(answered, 0) << "answered before the group's sync";
  EXPECT_EQ(fs.counts().syncs, 1u);
  clock.Advance(kInterval - std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(answered, 0) << "synced before the interval was up";
  clock.Advance(std::chrono::milliseconds(1));
  for (std::thread& push : pushes) push.join();
  EXPECT_EQ(answered, kPushes);
  EXPECT_EQ(fs.counts().syncs, 2u) << "one sync for the group of " << kPushes;
  EXPECT_EQ(fs.counts().synced, fs.counts().appended);
}

TEST(PushJournalSyncTest, AFailedSyncFailsItsAppendAndEveryLaterOne) {
  SyncLedgerFileSystem fs;
  auto journal = OpenSyncing(FreshDir("sync-fails"), fs, {.sync = PushJournal::Sync::kEveryPush});
  ASSERT_TRUE(journal->AppendPush(0, 0, 0, std::vector<float>(4, 1.0f)).ok());
  fs.set_fail_syncs(true);
  absl::Status appended = journal->AppendPush(0, 0, 1, std::vector<float>(4, 1.0f));
  EXPECT_EQ(appended.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(appended.message()), ::testing::HasSubstr("could not be synced"));
  fs.set_fail_syncs(false);
  appended = journal->AppendPush(0, 0, 1, std::vector<float>(4, 1.0f));
  EXPECT_EQ(appended.code(), absl::StatusCode::kDataLoss) << "what the file holds is unknown";
  EXPECT_THAT(std::string(appended.message()), ::testing::HasSubstr("restart it"));
}

}  // namespace
}  // namespace layercast::server
