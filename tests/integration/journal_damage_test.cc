// A training shard's push journal, written by a real shard that is then
// killed, and read back by the next start: one flipped bit in a middle
// record is damage and refuses the start (exit 2, one line naming the file,
// the offset and the last good step); --accept-journal-damage starts it at
// the last good record and counts the loss; a torn tail starts as before.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <boost/asio/ip/tcp.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>

#include "absl/strings/str_cat.h"
#include "client/gradient_sink.h"
#include "platform/file_system.h"
#include "server/training/journal_record.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"
#include "tools/synthetic_gradient.h"

namespace layercast::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kSteps = 6;

class JournalDamageTest : public ::testing::Test {
 protected:
  // Trains kSteps steps of one worker on one shard, pushing the layers in
  // order with each push answered before the next (so record r of the
  // journal is step r / layers, layer r % layers), then kills the shard as
  // a crash would: no checkpoint on exit, everything is in the journal.
  void SetUp() override {
    dir_ = MakeTempDir("journal-damage");
    const TestModel model = WriteTestModel(dir_ + "/model.safetensors", 2, 67);
    flags_ = {"--model",
              model.path,
              "--optimizer",
              "sgd:lr=0.5",
              "--data-parallel-workers",
              "1",
              "--checkpoint-dir",
              dir_,
              "--chunk-bytes",
              "4096",
              "--metrics-listen",
              "127.0.0.1:0"};
    RunningShards shards = StartShards(1, flags_);
    ASSERT_NE(shards.set, nullptr);
    const client::ShardSet& set = *shards.set;
    layers_ = static_cast<uint32_t>(set.model().layers.size());
    auto sink = client::GradientSink::Create(set, {.worker = 0, .chunk_bytes = 4096});
    ASSERT_TRUE(sink.ok()) << sink.status();
    for (uint64_t step = 0; step < kSteps; ++step) {
      for (uint32_t l = 0; l < layers_; ++l) {
        const AssembledLayout& layout = set.view().gradient_layouts[l];
        auto gradient = client::LayerBuffer::Allocate(layout.total_bytes());
        ASSERT_TRUE(gradient.ok());
        ASSERT_TRUE(
            tools::FillSyntheticGradient(layout, 0, step, l, {gradient->data(), gradient->size()})
                .ok());
        ASSERT_TRUE((*sink)->Push(l, step, *std::move(gradient)).ok());
        const absl::Status flushed = (*sink)->Flush();
        ASSERT_TRUE(flushed.ok()) << flushed;
      }
    }
    EXPECT_EQ(Versions(set), std::vector<uint64_t>(layers_, kSteps));
    shards.processes->KillForTest(0);
    journal_ = dir_ + "/shard-0-of-1.journal-0000000000000001";
    ASSERT_TRUE(std::filesystem::exists(journal_));
    // Where each push record starts (after the identity record).
    auto file = DefaultFileSystem().OpenForRead(journal_);
    ASSERT_TRUE(file.ok()) << file.status();
    for (uint64_t offset = 0; offset < (*file)->size();) {
      auto record = server::journal::ReadRecord(**file, offset);
      ASSERT_TRUE(record.ok() && record->has_value()) << "at " << offset;
      if ((*record)->header.kind == 1) offsets_.push_back(offset);
      offset += (*record)->length;
    }
    ASSERT_EQ(offsets_.size(), kSteps * layers_);
  }

  std::vector<uint64_t> Versions(const client::ShardSet& set) const {
    std::vector<uint64_t> versions;
    for (uint32_t l = 0; l < layers_; ++l) {
      absl::StatusOr<client::Layer> layer = set.Gather(l);
      EXPECT_TRUE(layer.ok()) << layer.status();
      versions.push_back(layer.ok() ? layer->version() : UINT64_MAX);
    }
    return versions;
  }

  // Flips one bit in the values of push record `r`.
  void FlipBitInRecord(size_t r) const {
    const auto at = static_cast<std::streamoff>(offsets_[r] + 32 + 10);
    std::fstream file(journal_, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(at);
    const char byte = static_cast<char>(file.get());
    file.seekp(at);
    file.put(static_cast<char>(byte ^ 0x04));
  }

  std::string dir_;
  std::vector<std::string> flags_;
  uint32_t layers_ = 0;
  std::string journal_;
  std::vector<uint64_t> offsets_;  // of each push record in journal_
};

TEST_F(JournalDamageTest, AFlippedBitMidJournalRefusesTheStartUnlessTheLossIsAccepted) {
  constexpr size_t kDamaged = 7;
  FlipBitInRecord(kDamaged);
  const uint64_t last_good_step = (kDamaged - 1) / layers_;

  {
    const std::string logs = MakeTempDir("journal-damage-refused");
    auto refused = StartProcesses(1, flags_, logs);
    ASSERT_NE(refused, nullptr);
    const absl::StatusOr<int> code = refused->WaitForExitForTest(0, std::chrono::seconds(60));
    ASSERT_TRUE(code.ok()) << "it kept running on a damaged journal: " << code.status();
    EXPECT_EQ(*code, 2);
    std::ifstream log(logs + "/shard-0.log");
    const std::string output((std::istreambuf_iterator<char>(log)),
                             std::istreambuf_iterator<char>());
    EXPECT_THAT(output, AllOf(HasSubstr(absl::StrCat("push journal ", journal_,
                                                     " is damaged at byte ", offsets_[kDamaged])),
                              HasSubstr(absl::StrCat("last good step: step ", last_good_step))));
    EXPECT_THAT(output, ::testing::Not(HasSubstr("; ready"))) << "it served the damaged journal";
  }

  // Accepted: the shard serves what the records before the damage hold,
  // and counts the loss.
  const std::string logs = MakeTempDir("journal-damage-logs");
  std::vector<std::string> flags = flags_;
  flags.insert(flags.end(), {"--accept-journal-damage", "true"});
  auto processes = StartProcesses(1, flags, logs);
  ASSERT_NE(processes, nullptr);
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::seconds(60);
  auto set = client::ShardSet::Connect(processes->addresses(), options);
  ASSERT_TRUE(set.ok()) << set.status();
  std::vector<uint64_t> expected(layers_);
  for (uint32_t l = 0; l < layers_; ++l) {
    expected[l] = kDamaged / layers_ + (l < kDamaged % layers_ ? 1 : 0);
  }
  EXPECT_EQ(Versions(**set), expected);
  const std::string metrics = ScrapeShard(logs + "/shard-0.log");
  EXPECT_THAT(metrics, HasSubstr("\nlayercast_push_journal_damage_total 1\n"));
  ASSERT_EQ(processes->Stop(), absl::OkStatus());
  EXPECT_TRUE(std::filesystem::exists(journal_ + ".damaged"));
}

// The last record cut short, as a death mid-append leaves it: replayed up
// to it, without any flag, as before.
TEST_F(JournalDamageTest, ATornTailStillStarts) {
  std::filesystem::resize_file(journal_, std::filesystem::file_size(journal_) - 100);
  RunningShards shards = StartShards(1, flags_);
  ASSERT_NE(shards.set, nullptr);
  std::vector<uint64_t> expected(layers_, kSteps);
  expected.back() = kSteps - 1;
  EXPECT_EQ(Versions(*shards.set), expected);
}

}  // namespace
}  // namespace layercast::testing
