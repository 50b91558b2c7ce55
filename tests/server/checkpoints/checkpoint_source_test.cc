// Starting from a checkpoint: a file of another model, shard, shard count or
// layout is refused with a message naming the file and the mismatch; a
// corrupt one (a flipped data byte, a truncated file) is refused too; reads
// in any order still have their checksum verified.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_join.h"
#include "server/checkpoints/checkpoint_format.h"
#include "server/checkpoints/checkpoint_source.h"
#include "server/checkpoints/checkpoint_writer.h"
#include "tests/server/checkpoints/checkpoint_test_util.h"

namespace layercast::server::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class CheckpointSourceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshDir("source");
    auto info = WriteCheckpoint(*LoadStore(values_, 1, 2), 9, dir_);
    ASSERT_TRUE(info.ok()) << info.status();
    path_ = info->path;
  }

  absl::Status OpenError(const ModelSpec& model, uint32_t shard, uint32_t num_shards,
                         const Policy& policy = TestPolicy()) {
    return CheckpointSource::Open(path_, model, shard, num_shards, policy).status();
  }

  // Overwrites one byte of the checkpoint file at `offset` from its end.
  void FlipByteFromEnd(uint64_t offset) {
    const uint64_t size = std::filesystem::file_size(path_);
    std::fstream file(path_, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(size - offset));
    char byte = 0;
    file.read(&byte, 1);
    byte ^= 0x01;
    file.seekp(static_cast<std::streamoff>(size - offset));
    file.write(&byte, 1);
  }

  const ShiftedSource values_{0.5f};
  std::string dir_, path_;
};

TEST_F(CheckpointSourceTest, AnotherModelIsRefusedNamingBoth) {
  const ShiftedSource other(0.5f, "another-model");
  const absl::Status status = OpenError(other.model(), 1, 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr(path_), HasSubstr("holds model 'ckpt-test-model'"),
                    HasSubstr("serves 'another-model'"), HasSubstr("move the file away")));
}

TEST_F(CheckpointSourceTest, AnotherShardOrShardCountIsRefused) {
  const absl::Status index = OpenError(values_.model(), 0, 2);
  EXPECT_EQ(index.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(index.message()),
              HasSubstr("it is shard 1 of 2 and this is shard 0 of 2"));
  const absl::Status count = OpenError(values_.model(), 1, 3);
  EXPECT_EQ(count.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(count.message()),
              HasSubstr("it is shard 1 of 2 and this is shard 1 of 3"));
}

TEST_F(CheckpointSourceTest, AnotherPolicyIsALayoutMismatch) {
  const absl::Status status = OpenError(values_.model(), 1, 2, *Policy::Parse("p=f32,c=f16"));
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("layout digest"), HasSubstr("compute=float16")));
}

TEST_F(CheckpointSourceTest, AnotherShapeIsRefusedNamingTheTensor) {
  ShiftedSource reshaped(0.5f);
  ModelSpec model = reshaped.model();
  model.layers[2].tensors[0].shape = {7, 14};
  model.layers[2].tensors[0].num_elements = 98;
  // The digest covers shapes too; a matching digest with other element
  // counts cannot happen, so the digest is what reports it.
  const absl::Status status = OpenError(model, 1, 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("layout digest"));
}

TEST_F(CheckpointSourceTest, AFlippedDataByteFailsTheChecksum) {
  FlipByteFromEnd(5);  // inside the last tensor's data
  auto source = CheckpointSource::Open(path_, values_.model(), 1, 2, TestPolicy());
  ASSERT_TRUE(source.ok()) << source.status() << " (the header is intact)";
  auto store = LoadStore(**source, 1, 2);
  ASSERT_NE(store, nullptr);
  const absl::Status verified = (*source)->VerifyChecksum();
  EXPECT_EQ(verified.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(verified.message()), AllOf(HasSubstr(path_), HasSubstr("is corrupt"),
                                                     HasSubstr("header records sha256:")));
}

TEST_F(CheckpointSourceTest, ATruncatedFileIsRefusedAtOpen) {
  std::filesystem::resize_file(path_, std::filesystem::file_size(path_) - 4);
  const absl::Status status = OpenError(values_.model(), 1, 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr(path_), HasSubstr("cannot be read as a safetensors file")));
}

TEST_F(CheckpointSourceTest, AnyFileThatIsNotACheckpointIsRefused) {
  std::ofstream(path_, std::ios::trunc) << "not a checkpoint";
  EXPECT_EQ(OpenError(values_.model(), 1, 2).code(), absl::StatusCode::kDataLoss);
}

TEST_F(CheckpointSourceTest, ReadsOutOfOrderAreVerifiedByReadingAgain) {
  auto source = CheckpointSource::Open(path_, values_.model(), 1, 2, TestPolicy());
  ASSERT_TRUE(source.ok()) << source.status();
  // The last tensor first, then one part of another: not the load order.
  const ModelSpec& model = values_.model();
  const ElementRange head = ShardElementRange(model.layers[2].tensors[0].num_elements, 1, 2);
  std::vector<float> buffer(head.size());
  ASSERT_TRUE((*source)->Read(2, 0, head, buffer).ok());
  EXPECT_EQ(buffer[0], values_.Value(2, 0, head.begin));
  const ElementRange big = ShardElementRange(model.layers[1].tensors[1].num_elements, 1, 2);
  buffer.resize(3);
  ASSERT_TRUE((*source)->Read(1, 1, ElementRange{big.begin + 10, big.begin + 13}, buffer).ok());
  EXPECT_EQ(buffer[2], values_.Value(1, 1, big.begin + 12));
  EXPECT_TRUE((*source)->VerifyChecksum().ok());
}

TEST_F(CheckpointSourceTest, ElementsOfOtherShardsAreOutOfRange) {
  auto source = CheckpointSource::Open(path_, values_.model(), 1, 2, TestPolicy());
  ASSERT_TRUE(source.ok()) << source.status();
  std::vector<float> buffer(1);
  const absl::Status status = (*source)->Read(0, 0, ElementRange{0, 1}, buffer);
  EXPECT_EQ(status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(status.message()), HasSubstr("holds elements ["));
}

}  // namespace

// Training metadata as a training shard writes it: optimizer, every layer's
// version and step count, and (since staged pushes are saved) staged_pushes.
CheckpointExtras TrainingExtras(const ParameterStore& store, const std::string& staged) {
  CheckpointExtras extras;
  std::vector<std::string> versions(store.model().layers.size(), "3");
  extras.metadata = {{"optimizer", "sgd:lr=0.1"},
                     {"layer_versions", absl::StrJoin(versions, ",")},
                     {"optimizer_steps", absl::StrJoin(versions, ",")}};
  if (staged != "(absent)") extras.metadata["staged_pushes"] = staged;
  return extras;
}

// A checkpoint written before staged pushes were saved has no staged_pushes
// key: it opens, with none. A staged push it lists is read back; one it does
// not list, or lists without holding, is damage.
TEST_F(CheckpointSourceTest, StagedPushesAreReadBackAndCheckedAgainstTheirList) {
  const auto store = LoadStore(values_, 1, 2);
  const ModelSpec& model = store->model();
  const std::vector<float> push(7, 0.25f);  // the source does not size staged pushes
  struct Case {
    std::string listed;
    bool holds_tensor;
    bool opens;
  };
  for (const Case& c : {Case{"(absent)", false, true}, Case{"0/1", true, true},
                        Case{"", true, false}, Case{"0/1", false, false}}) {
    SCOPED_TRACE(c.listed);
    const std::string dir = FreshDir("staged");
    CheckpointExtras extras = TrainingExtras(*store, c.listed);
    if (c.holds_tensor) extras.tensors.emplace_back(StagedPushName(0, "1"), push);
    auto info = WriteCheckpoint(*store, 3, dir, DefaultFileSystem(), extras);
    ASSERT_TRUE(info.ok()) << info.status();
    auto source = CheckpointSource::Open(info->path, model, 1, 2, TestPolicy());
    ASSERT_EQ(source.ok(), c.opens) << source.status();
    if (!c.opens) {
      EXPECT_EQ(source.status().code(), absl::StatusCode::kDataLoss);
      continue;
    }
    ASSERT_TRUE((*source)->training().has_value());
    if (c.listed == "(absent)") {
      EXPECT_TRUE((*source)->training()->staged.empty());
      continue;
    }
    ASSERT_EQ((*source)->training()->staged.size(), 1u);
    std::vector<float> values;
    ASSERT_TRUE((*source)->ReadState(StagedPushName(0, "1"), values).ok());
    EXPECT_EQ(values, push);
  }
}

// The last clipped step's scale comes back bit for bit; a checkpoint
// without it has none, and a garbled one is damage.
TEST_F(CheckpointSourceTest, TheLastClipScaleIsReadBack) {
  const auto store = LoadStore(values_, 1, 2);
  const float scale = 0.3f;
  for (const std::string& recorded : {absl::StrCat("7,", std::bit_cast<uint32_t>(scale)),
                                      std::string("(absent)"), std::string("7;1")}) {
    SCOPED_TRACE(recorded);
    const std::string dir = FreshDir("clip");
    CheckpointExtras extras = TrainingExtras(*store, "(absent)");
    if (recorded != "(absent)") extras.metadata["last_clip"] = recorded;
    auto info = WriteCheckpoint(*store, 3, dir, DefaultFileSystem(), extras);
    ASSERT_TRUE(info.ok()) << info.status();
    auto source = CheckpointSource::Open(info->path, store->model(), 1, 2, TestPolicy());
    if (recorded == "7;1") {
      EXPECT_EQ(source.status().code(), absl::StatusCode::kDataLoss);
      continue;
    }
    ASSERT_TRUE(source.ok()) << source.status();
    const auto& clip = (*source)->training()->last_clip;
    if (recorded == "(absent)") {
      EXPECT_FALSE(clip.has_value());
    } else {
      ASSERT_TRUE(clip.has_value());
      EXPECT_EQ(clip->first, 7u);
      EXPECT_EQ(std::bit_cast<uint32_t>(clip->second), std::bit_cast<uint32_t>(scale));
    }
  }
}

}  // namespace layercast::server::testing
