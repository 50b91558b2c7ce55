// Which values a shard serves, told apart by content and not only by layout:
// shards of two checkpoints of one model (same file name, names, shapes and
// policy) are refused as one set, and a shard restarted with other values is
// refused mid-gather instead of being mixed into the layer.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/training/push_journal.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Both under one model id, as a trainer's checkpoints of one model are.
std::unique_ptr<tools::LocalShardSet> StartSet(const std::string& model_path) {
  return StartProcesses(2, {"--model", model_path, "--model-id", "the-model"});
}

TEST(IdentityTest, ShardsOfTwoCheckpointsOfOneModelAreNotOneSet) {
  // Two training steps of one model, each saved as model.safetensors.
  const TestModel step1 = WriteTestModel(MakeTempDir("step1") + "/model.safetensors", 2, 21);
  const TestModel step2 = WriteTestModel(MakeTempDir("step2") + "/model.safetensors", 2, 22);
  auto first = StartSet(step1.path);
  auto second = StartSet(step2.path);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::seconds(60);
  auto same = client::ShardSet::Connect(first->addresses(), options);
  ASSERT_TRUE(same.ok()) << same.status();
  auto mixed = client::ShardSet::Connect({first->addresses()[0], second->addresses()[1]}, options);
  ASSERT_FALSE(mixed.ok());
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(mixed.status().message()),
              AllOf(HasSubstr(second->addresses()[1]), HasSubstr("content fingerprint")));
}

TEST(IdentityTest, AShardRestartedWithOtherValuesIsRefusedMidGather) {
  const std::string path = MakeTempDir("replaced") + "/model.safetensors";
  WriteTestModel(path, 2, 31);
  auto processes = StartSet(path);
  ASSERT_NE(processes, nullptr);
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::seconds(60);
  auto set = client::ShardSet::Connect(processes->addresses(), options);
  ASSERT_TRUE(set.ok()) << set.status();
  ASSERT_TRUE((*set)->Gather(1).ok());

  // The same layout, other values, under the same name; shard 1 restarts
  // on it at version 0, like the shard it replaces.
  processes->KillForTest(1);
  WriteTestModel(path, 2, 32);
  ASSERT_TRUE(processes->RestartForTest(1).ok());
  client::GatherOptions gather;
  gather.timeout = std::chrono::seconds(30);
  absl::StatusOr<client::Layer> layer = (*set)->Gather(1, gather);
  ASSERT_FALSE(layer.ok()) << "a layer mixing two models was gathered";
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(layer.status().message()),
              AllOf(HasSubstr("shard 1"), HasSubstr("restarted with another model")));
}

// A push journal names the model, layout, content and shard it was written
// for: one left in --checkpoint-dir by another model's shard refuses the
// start (exit 2, one line naming the file) instead of being replayed here.
TEST(IdentityTest, AJournalOfAnotherModelRefusesTheStart) {
  const std::string dir = MakeTempDir("foreign-journal");
  const TestModel model = WriteTestModel(dir + "/model.safetensors", 2, 41);
  layercast::v1::JournalIdentity theirs;
  theirs.set_model_id("model-a");
  theirs.set_shard_index(0);
  theirs.set_num_shards(1);
  {
    auto journal = server::PushJournal::Open(dir, theirs);
    ASSERT_TRUE(journal.ok()) << journal.status();
    ASSERT_TRUE((*journal)->AppendClipScale(1, 0.5f).ok());
  }
  std::string output;
  const int code = RunCommand(
      absl::StrCat(ShardBinary(), " --listen 127.0.0.1:0 --shard-index 0 --num-shards 1 --model ",
                   model.path, " --model-id model-b --checkpoint-dir ", dir,
                   " --optimizer sgd:lr=0.5 --data-parallel-workers 1"),
      &output);
  EXPECT_EQ(code, 2) << output;
  EXPECT_THAT(output, AllOf(HasSubstr("push journal " + dir + "/shard-0-of-1.journal-"),
                            HasSubstr("written for model 'model-a', and this shard serves "
                                      "'model-b'")));
  EXPECT_THAT(output, ::testing::Not(HasSubstr("listening on"))) << "it began to serve";
}

}  // namespace
}  // namespace layercast::testing
