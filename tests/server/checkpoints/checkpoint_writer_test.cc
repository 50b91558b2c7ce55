// Checkpoint writes through a file system that fails, or "crashes", at every
// operation in turn: afterwards the previous checkpoint is still there, bit
// for bit, and loads; no partial file ever has the checkpoint's name; and a
// later write succeeds. Checkpoints are private (0600) and a symbolic link
// planted where the temporary file goes is never followed.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "server/checkpoints/checkpoint_format.h"
#include "server/checkpoints/checkpoint_manager.h"
#include "server/checkpoints/checkpoint_source.h"
#include "server/checkpoints/checkpoint_writer.h"
#include "tests/server/checkpoints/checkpoint_test_util.h"

namespace layercast::server::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint32_t kShard = 2;
constexpr uint32_t kNumShards = 3;

// Loads `dir`'s checkpoint of shard kShard as a server would at start and
// checks every value against `expected` and the version.
void ExpectLoads(const std::string& dir, const ShiftedSource& expected, uint64_t version) {
  auto source = CheckpointSource::Open(CheckpointPath(dir, kShard, kNumShards), expected.model(),
                                       kShard, kNumShards, TestPolicy());
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ((*source)->version(), version);
  auto store = LoadStore(**source, kShard, kNumShards);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE((*source)->VerifyChecksum().ok());
  EXPECT_TRUE(SameValues(*store, expected));
}

// The temporary files of shard kShard's writes in `dir`, whatever their
// nonce.
std::vector<std::string> Temporaries(const std::string& dir) {
  const std::string prefix = absl::StrCat(".", CheckpointFileName(kShard, kNumShards), ".tmp-");
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) names.push_back(name);
  }
  return names;
}

// The names in `dir` that look like a checkpoint (not hidden temporaries).
std::vector<std::string> CheckpointNames(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name[0] != '.') names.push_back(name);
  }
  return names;
}

TEST(CheckpointWriterTest, RoundTripIsBitExactForEveryShard) {
  const ShiftedSource values(0.25f);
  const std::string dir = FreshDir("round-trip");
  for (uint32_t shard = 0; shard < kNumShards; ++shard) {
    auto store = LoadStore(values, shard, kNumShards);
    auto info = WriteCheckpoint(*store, 7 + shard, dir);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->path, CheckpointPath(dir, shard, kNumShards));
    EXPECT_EQ(info->bytes, std::filesystem::file_size(info->path));
    EXPECT_THAT(info->checksum, ::testing::StartsWith("sha256:"));

    auto source =
        CheckpointSource::Open(info->path, values.model(), shard, kNumShards, TestPolicy());
    ASSERT_TRUE(source.ok()) << source.status();
    EXPECT_EQ((*source)->version(), 7 + shard);
    EXPECT_EQ((*source)->checksum(), info->checksum);
    auto loaded = LoadStore(**source, shard, kNumShards);
    ASSERT_TRUE((*source)->VerifyChecksum().ok());
    EXPECT_TRUE(SameValues(*loaded, values)) << "shard " << shard;
  }
  EXPECT_EQ(CheckpointNames(dir).size(), kNumShards);
}

TEST(CheckpointWriterTest, MetadataNamesTheShardModelAndFormat) {
  const ShiftedSource values(0);
  const std::string dir = FreshDir("metadata");
  auto store = LoadStore(values, 1, kNumShards);
  ASSERT_TRUE(WriteCheckpoint(*store, 42, dir).ok());
  auto reader = SafetensorsReader::Open(CheckpointPath(dir, 1, kNumShards));
  ASSERT_TRUE(reader.ok()) << reader.status();
  const auto& metadata = (*reader)->metadata();
  EXPECT_EQ(metadata.at("format"), "layercast-shard-checkpoint");
  EXPECT_EQ(metadata.at("format_version"), "1");
  EXPECT_EQ(metadata.at("model_id"), "ckpt-test-model");
  EXPECT_EQ(metadata.at("num_shards"), "3");
  EXPECT_EQ(metadata.at("shard_index"), "1");
  EXPECT_EQ(metadata.at("version"), "42");
  EXPECT_EQ(metadata.at("policy"), TestPolicy().ToString());
  EXPECT_EQ(metadata.at("layout_digest"), HexString(store->layout_digest()));
  // One 1-D F32 tensor per model tensor, of the owned element count.
  const SafetensorsTensor* big = (*reader)->Find("block.0.big.weight");
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(big->dtype, DType::kFloat32);
  EXPECT_EQ(big->shape, std::vector<int64_t>{static_cast<int64_t>(store->owned(1, 1).size())});
  const SafetensorsTensor* norm = (*reader)->Find("block.0.norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->num_elements, 0u) << "shard 1 of 3 owns none of a 1-element tensor";
}

// The permission bits of `path` (not following a symbolic link there).
std::filesystem::perms Permissions(const std::string& path) {
  return std::filesystem::symlink_status(path).permissions();
}

TEST(CheckpointWriterTest, APlantedSymlinkIsNotFollowedAndTheCheckpointIsPrivate) {
  const ShiftedSource values(0.5f);
  const std::string dir = FreshDir("symlink");
  const std::string victim = FreshDir("victim") + "/precious";
  std::ofstream(victim) << "not a checkpoint";
  // Where older versions wrote, predictably: the directory's writer pid.
  const std::string predicted =
      absl::StrCat(dir, "/.", CheckpointFileName(kShard, kNumShards), ".tmp-", getpid());
  std::filesystem::create_symlink(victim, predicted);

  // Even with nothing masked, the checkpoint is the owner's alone.
  const mode_t old_umask = umask(0);
  auto info = WriteCheckpoint(*LoadStore(values, kShard, kNumShards), 4, dir);
  umask(old_umask);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(ReadFileBytes(victim) == "not a checkpoint") << "the write followed the symlink";
  EXPECT_TRUE(std::filesystem::is_symlink(predicted));
  ExpectLoads(dir, values, 4);
  using std::filesystem::perms;
  EXPECT_EQ(Permissions(info->path) & (perms::group_all | perms::others_all), perms::none)
      << "mode " << std::oct << static_cast<int>(Permissions(info->path));

  // The planted link looks like one of our temporaries: a restart removes
  // the link itself, never what it points to.
  auto manager = CheckpointManager::Create(dir, kShard, kNumShards);
  ASSERT_TRUE(manager.ok()) << manager.status();
  EXPECT_EQ((*manager)->RemoveStaleTemporaries(), 1);
  EXPECT_FALSE(std::filesystem::is_symlink(predicted));
  EXPECT_TRUE(ReadFileBytes(victim) == "not a checkpoint");
}

// The real file system, except that it plants a symbolic link to `target` at
// whatever name a private file is about to be created: the race an attacker
// would have to win against an unpredictable name.
class PlantingFileSystem final : public FileSystem {
 public:
  explicit PlantingFileSystem(std::string target) : target_(std::move(target)) {}
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    return real_.OpenForRead(path);
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const std::string& path) override {
    return real_.OpenForWrite(path);
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> CreatePrivate(const std::string& path) override {
    std::filesystem::create_symlink(target_, path);
    planted_ = path;
    return real_.CreatePrivate(path);
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    return real_.Rename(from, to);
  }
  absl::Status SyncDir(const std::string& dir) override { return real_.SyncDir(dir); }
  absl::Status Remove(const std::string& path) override { return real_.Remove(path); }
  bool Exists(const std::string& path) override { return real_.Exists(path); }

  const std::string& planted() const { return planted_; }

 private:
  FileSystem& real_ = DefaultFileSystem();
  const std::string target_;
  std::string planted_;
};

TEST(CheckpointWriterTest, ALinkAtTheChosenNameFailsTheWriteAndIsLeftAlone) {
  const ShiftedSource old_values(0), new_values(2.0f);
  const std::string dir = FreshDir("planted");
  ASSERT_TRUE(WriteCheckpoint(*LoadStore(old_values, kShard, kNumShards), 1, dir).ok());
  const std::string previous = ReadFileBytes(CheckpointPath(dir, kShard, kNumShards));
  const std::string victim = FreshDir("victim") + "/precious";
  std::ofstream(victim) << "not a checkpoint";

  PlantingFileSystem fs(victim);
  auto info = WriteCheckpoint(*LoadStore(new_values, kShard, kNumShards), 2, dir, fs);
  EXPECT_EQ(info.status().code(), absl::StatusCode::kAlreadyExists) << info.status();
  EXPECT_THAT(std::string(info.status().message()), HasSubstr("is unchanged"));
  EXPECT_TRUE(ReadFileBytes(victim) == "not a checkpoint") << "the write followed the symlink";
  EXPECT_TRUE(std::filesystem::is_symlink(fs.planted())) << "someone else's link was removed";
  EXPECT_TRUE(ReadFileBytes(CheckpointPath(dir, kShard, kNumShards)) == previous);
  ExpectLoads(dir, old_values, 1);
}

struct FaultCase {
  FaultyFileSystem::Mode mode;
  bool with_previous;
};

class CheckpointFaultTest : public ::testing::TestWithParam<FaultCase> {};

TEST_P(CheckpointFaultTest, EveryFailurePointKeepsThePreviousCheckpoint) {
  const FaultCase fault = GetParam();
  const ShiftedSource old_values(0), new_values(1.5f);
  auto old_store = LoadStore(old_values, kShard, kNumShards);
  auto new_store = LoadStore(new_values, kShard, kNumShards);

  // How many operations a whole write takes.
  const std::string probe_dir = FreshDir("probe");
  FaultyFileSystem counter(FaultyFileSystem::kNever, FaultyFileSystem::Mode::kError);
  ASSERT_TRUE(WriteCheckpoint(*new_store, 2, probe_dir, counter).ok());
  const int64_t operations = counter.operations();
  // Open, two header appends, more than one data append, sync, close,
  // reopen, rename, dir sync.
  ASSERT_GE(operations, 10);

  for (int64_t fail_at = 0; fail_at < operations; ++fail_at) {
    SCOPED_TRACE(::testing::Message() << "failing operation " << fail_at << " of " << operations);
    const std::string dir = FreshDir("at-" + std::to_string(fail_at));
    std::string previous;
    if (fault.with_previous) {
      ASSERT_TRUE(WriteCheckpoint(*old_store, 1, dir).ok());
      previous = ReadFileBytes(CheckpointPath(dir, kShard, kNumShards));
    }

    FaultyFileSystem fs(fail_at, fault.mode);
    absl::StatusOr<CheckpointInfo> info = WriteCheckpoint(*new_store, 2, dir, fs);
    ASSERT_FALSE(info.ok()) << "an injected fault must be reported";
    EXPECT_THAT(std::string(info.status().message()), HasSubstr("injected fault"));

    const std::string path = CheckpointPath(dir, kShard, kNumShards);
    if (fs.renamed()) {
      // Only the directory sync failed: the new checkpoint is in place, whole.
      EXPECT_THAT(std::string(info.status().message()), HasSubstr("may not survive"));
      ExpectLoads(dir, new_values, 2);
    } else if (fault.with_previous) {
      EXPECT_THAT(std::string(info.status().message()), HasSubstr("is unchanged"));
      ASSERT_EQ(ReadFileBytes(path), previous) << "the previous checkpoint changed";
      ExpectLoads(dir, old_values, 1);
    } else {
      EXPECT_FALSE(std::filesystem::exists(path)) << "a partial file has the checkpoint's name";
    }
    EXPECT_EQ(CheckpointNames(dir).size(), fault.with_previous || fs.renamed() ? 1u : 0u);

    // What a restarted server sees and does: the checkpoint (or none), any
    // torn temporary removed, and the next write succeeds.
    auto manager = CheckpointManager::Create(dir, kShard, kNumShards);
    ASSERT_TRUE(manager.ok()) << manager.status();
    const bool left_temporary = !Temporaries(dir).empty();
    EXPECT_LE(Temporaries(dir).size(), 1u);
    if (fault.mode == FaultyFileSystem::Mode::kError) {
      EXPECT_FALSE(left_temporary) << "the writer removes its temporary file after an error";
    }
    EXPECT_EQ((*manager)->RemoveStaleTemporaries(), left_temporary ? 1 : 0);
    auto existing = (*manager)->FindExisting();
    ASSERT_TRUE(existing.ok()) << existing.status();
    EXPECT_EQ(existing->has_value(), fault.with_previous || fs.renamed());
    ASSERT_TRUE((*manager)->Write(*new_store, 3).ok());
    ExpectLoads(dir, new_values, 3);
    // The checkpoint, and the lock of the manager that wrote it.
    EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                            std::filesystem::directory_iterator()),
              2);
    EXPECT_TRUE(std::filesystem::exists(dir + "/shard-" + std::to_string(kShard) + ".lock"));
  }
}

INSTANTIATE_TEST_SUITE_P(Faults, CheckpointFaultTest,
                         ::testing::Values(FaultCase{FaultyFileSystem::Mode::kError, true},
                                           FaultCase{FaultyFileSystem::Mode::kCrash, true},
                                           FaultCase{FaultyFileSystem::Mode::kError, false},
                                           FaultCase{FaultyFileSystem::Mode::kCrash, false}),
                         [](const ::testing::TestParamInfo<FaultCase>& info) {
                           return std::string(info.param.mode == FaultyFileSystem::Mode::kError
                                                  ? "Error"
                                                  : "Crash") +
                                  (info.param.with_previous ? "WithPrevious" : "First");
                         });

TEST(CheckpointManagerTest, OneWriteAtATimeAndTracksTheVersionOnDisk) {
  const ShiftedSource values(0);
  const std::string dir = FreshDir("manager");
  auto store = LoadStore(values, kShard, kNumShards);
  auto manager = CheckpointManager::Create(dir, kShard, kNumShards);
  ASSERT_TRUE(manager.ok()) << manager.status();
  EXPECT_FALSE((*manager)->HoldsVersion(0));
  ASSERT_TRUE((*manager)->TryWrite(*store, 5).ok());
  EXPECT_TRUE((*manager)->HoldsVersion(5));
  EXPECT_FALSE((*manager)->HoldsVersion(6));
  std::filesystem::remove((*manager)->path());
  EXPECT_FALSE((*manager)->HoldsVersion(5)) << "the file is gone";
}

// Two managers of one shard index in one directory would write one file:
// the second is refused while the first lives, naming its process.
TEST(CheckpointManagerTest, OneManagerPerShardIndexAndDirectory) {
  const std::string dir = FreshDir("lock");
  auto first = CheckpointManager::Create(dir, 0, 2);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = CheckpointManager::Create(dir, 0, 2);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr(absl::StrCat("(pid ", getpid(), ") holds ", dir, "/shard-0.lock")));
  EXPECT_TRUE(CheckpointManager::Create(dir, 1, 2).ok()) << "another index has its own lock";
  first->reset();
  EXPECT_TRUE(CheckpointManager::Create(dir, 0, 2).ok()) << "the lock went with its manager";
}

TEST(CheckpointManagerTest, RefusesAMissingDirectoryAndFindsAnotherCountsSet) {
  auto missing = CheckpointManager::Create("/nonexistent/layercast", 0, 2);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("create it"));

  const ShiftedSource values(0);
  const std::string dir = FreshDir("reshard");
  ASSERT_TRUE(WriteCheckpoint(*LoadStore(values, 0, 2), 0, dir).ok());
  auto manager = CheckpointManager::Create(dir, 0, 3);
  ASSERT_TRUE(manager.ok());
  auto existing = (*manager)->FindExisting();
  ASSERT_TRUE(existing.ok()) << existing.status();
  EXPECT_FALSE(existing->has_value()) << "no file of shard 0 of 3";
  auto source = (*manager)->FindReshardSource();
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ(*source, std::optional<uint32_t>(2)) << "shard 0 of 3 loads the 2 shards' set";
  manager->reset();

  // This count's file of another index beside the other set: the shards of
  // this count would start at two steps.
  ASSERT_TRUE(WriteCheckpoint(*LoadStore(values, 1, 3), 0, dir).ok());
  manager = CheckpointManager::Create(dir, 0, 3);
  ASSERT_TRUE(manager.ok());
  source = (*manager)->FindReshardSource();
  EXPECT_EQ(source.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(source.status().message()),
              HasSubstr("holds shard-1-of-3.safetensors but not shard-0-of-3.safetensors"));
  manager->reset();

  // Two other counts: which to load is not clear.
  std::filesystem::remove(dir + "/shard-1-of-3.safetensors");
  ASSERT_TRUE(WriteCheckpoint(*LoadStore(values, 0, 4), 0, dir).ok());
  manager = CheckpointManager::Create(dir, 0, 3);
  ASSERT_TRUE(manager.ok());
  source = (*manager)->FindReshardSource();
  EXPECT_EQ(source.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(source.status().message()), HasSubstr("checkpoints of 2 and 4 shards"));
}

}  // namespace
}  // namespace layercast::server::testing
