// ReshardedCheckpoint: shard j of M reads its ranges of the checkpoints N
// shards wrote, and only the bytes it needs; the N must be one set.

#include "server/checkpoints/checkpoint_reshard.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/synthetic_model.h"
#include "server/checkpoints/checkpoint_writer.h"
#include "tests/server/checkpoints/checkpoint_test_util.h"

namespace layercast::server::testing {
namespace {

using ::testing::HasSubstr;

// The real file system, counting the bytes read through it.
class CountingFileSystem final : public FileSystem {
 public:
  // Bytes of the files read at least once (headers included).
  uint64_t distinct_bytes_read() const {
    absl::MutexLock lock(&mu_);
    uint64_t total = 0;
    for (const auto& [path, ranges] : ranges_) {
      uint64_t covered_to = 0;
      for (const auto& [begin, end] : ranges) {
        if (end <= covered_to) continue;
        total += end - std::max(begin, covered_to);
        covered_to = end;
      }
    }
    return total;
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    auto file = DefaultFileSystem().OpenForRead(path);
    if (!file.ok()) return file.status();
    return std::unique_ptr<RandomAccessFile>(new Counted(*std::move(file), *this));
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const std::string& path) override {
    return DefaultFileSystem().OpenForWrite(path);
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> CreatePrivate(const std::string& path) override {
    return DefaultFileSystem().CreatePrivate(path);
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    return DefaultFileSystem().Rename(from, to);
  }
  absl::Status SyncDir(const std::string& dir) override { return DefaultFileSystem().SyncDir(dir); }
  absl::Status Remove(const std::string& path) override { return DefaultFileSystem().Remove(path); }
  bool Exists(const std::string& path) override { return DefaultFileSystem().Exists(path); }

 private:
  class Counted final : public RandomAccessFile {
   public:
    Counted(std::unique_ptr<RandomAccessFile> file, CountingFileSystem& fs)
        : file_(std::move(file)), fs_(fs) {}
    uint64_t size() const override { return file_->size(); }
    absl::Status ReadAt(uint64_t offset, std::span<uint8_t> out) const override {
      {
        absl::MutexLock lock(&fs_.mu_);
        fs_.ranges_[file_->path()].insert({offset, offset + out.size()});
      }
      return file_->ReadAt(offset, out);
    }
    const std::string& path() const override { return file_->path(); }
    FilePermissions permissions() const override { return file_->permissions(); }

   private:
    std::unique_ptr<RandomAccessFile> file_;
    CountingFileSystem& fs_;
  };
  mutable absl::Mutex mu_;
  // Per file, the byte ranges read, sorted.
  std::map<std::string, std::set<std::pair<uint64_t, uint64_t>>> ranges_ ABSL_GUARDED_BY(mu_);
};

void WriteSet(const ShiftedSource& values, uint32_t count, const std::string& dir) {
  for (uint32_t i = 0; i < count; ++i) {
    ASSERT_TRUE(WriteCheckpoint(*LoadStore(values, i, count), 0, dir).ok());
  }
}

TEST(ReshardedCheckpointTest, EachCountReadsItsRangesOfTheTwoFilesBitForBit) {
  const ShiftedSource values(0.25f);
  const std::string dir = FreshDir("two");
  WriteSet(values, 2, dir);
  for (const uint32_t count : {1u, 3u, 5u}) {
    for (uint32_t j = 0; j < count; ++j) {
      auto checkpoint = ReshardedCheckpoint::Open(dir, 2, values.model(), j, count, TestPolicy());
      ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
      auto store = ParameterStore::Load(**checkpoint, j, count, TestPolicy());
      ASSERT_TRUE(store.ok()) << store.status();
      EXPECT_TRUE(SameValues(**store, values)) << "shard " << j << " of " << count;
      EXPECT_TRUE((*checkpoint)->VerifyChecksum().ok());
    }
  }
}

TEST(ReshardedCheckpointTest, AShardOfEightReadsItsOwnBytesAndTheBlocksAroundThem) {
  // Two tensors of 2M elements (embeddings and head) and small ones: each
  // file of 4 holds 4 MiB, and shard 3 of 8 owns the second half of file 1.
  auto model = SyntheticModel::Create("llama:layers=1,hidden=64,ffn=64,vocab=32768");
  ASSERT_TRUE(model.ok());
  const std::string dir = FreshDir("four");
  uint64_t data_bytes = 0;
  for (uint32_t i = 0; i < 4; ++i) {
    auto store = LoadStore(**model, i, 4);
    ASSERT_TRUE(WriteCheckpoint(*store, 0, dir).ok());
  }
  for (const LayerSpec& layer : (*model)->model().layers) {
    for (const TensorSpec& tensor : layer.tensors) data_bytes += tensor.num_elements * 4;
  }
  CountingFileSystem fs;
  auto checkpoint =
      ReshardedCheckpoint::Open(dir, 4, (*model)->model(), 3, 8, TestPolicy(), std::nullopt, fs);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->overlapping(), std::vector<uint32_t>{1});
  ASSERT_TRUE(ParameterStore::Load(**checkpoint, 3, 8, TestPolicy()).ok());
  ASSERT_TRUE((*checkpoint)->VerifyChecksum().ok());
  // Its eighth of the data, the blocks around its ranges (three tensors'
  // worth of edges) and the four headers: well under the quarter of the
  // data in the file its ranges lie in, which a whole-file check reads.
  const uint64_t distinct = fs.distinct_bytes_read();
  EXPECT_GE(distinct, data_bytes / 8);
  EXPECT_LT(distinct, data_bytes / 8 + 4 * kChecksumBlockBytes);
  EXPECT_LT(distinct, data_bytes / 4);
}

TEST(ReshardedCheckpointTest, AFlippedByteInABlockItReadsRefusesTheLoad) {
  const ShiftedSource values(0);
  const std::string dir = FreshDir("flipped");
  WriteSet(values, 2, dir);
  const std::string file = dir + "/shard-1-of-2.safetensors";
  {
    std::fstream bytes(file, std::ios::in | std::ios::out | std::ios::binary);
    bytes.seekg(-8, std::ios::end);
    char byte = 0;
    bytes.read(&byte, 1);
    byte ^= 0x01;
    bytes.seekp(-8, std::ios::end);
    bytes.write(&byte, 1);
  }
  // The last shard of 3 reads the end of shard 1 of 2's file.
  auto checkpoint = ReshardedCheckpoint::Open(dir, 2, values.model(), 2, 3, TestPolicy());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ASSERT_TRUE(ParameterStore::Load(**checkpoint, 2, 3, TestPolicy()).ok());
  const absl::Status verified = (*checkpoint)->VerifyChecksum();
  EXPECT_EQ(verified.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(verified.message()),
              HasSubstr("checkpoint " + file + " is corrupt: its data bytes ["));
}

TEST(ReshardedCheckpointTest, TheNMustBeOneSetAndAllThere) {
  const ShiftedSource values(0);
  const std::string dir = FreshDir("apart");
  ASSERT_TRUE(WriteCheckpoint(*LoadStore(values, 0, 2), 3, dir).ok());
  auto missing = ReshardedCheckpoint::Open(dir, 2, values.model(), 0, 3, TestPolicy());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("shard-1-of-2.safetensors is missing: shard 0 of 3 loads the "
                        "checkpoints 2 shards wrote"));
  ASSERT_TRUE(WriteCheckpoint(*LoadStore(values, 1, 2), 4, dir).ok());
  auto apart = ReshardedCheckpoint::Open(dir, 2, values.model(), 0, 3, TestPolicy());
  EXPECT_EQ(apart.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(apart.status().message()),
              HasSubstr("holds version 3 and " + dir + "/shard-1-of-2.safetensors holds 4"));
  EXPECT_THAT(std::string(apart.status().message()), HasSubstr("--num-shards 2"));
}

TEST(SliceOverlapTest, PiecesTileBothShardsLayouts) {
  const ShiftedSource values(0);
  for (const LayerSpec& layer : values.model().layers) {
    for (const auto& [from, to] : {std::pair{2u, 3u}, std::pair{4u, 1u}, std::pair{3u, 8u}}) {
      // Every element of each new shard's slice comes from exactly one old
      // shard.
      for (uint32_t j = 0; j < to; ++j) {
        uint64_t owned = 0;
        for (const TensorSpec& tensor : layer.tensors) {
          owned += ShardElementRange(tensor.num_elements, j, to).size();
        }
        std::vector<int> covered(owned, 0);
        for (uint32_t i = 0; i < from; ++i) {
          for (const SliceOverlap& piece : LayerOverlaps(layer, i, from, j, to)) {
            const ElementRange theirs =
                ShardElementRange(layer.tensors[piece.tensor].num_elements, i, from);
            EXPECT_GE(piece.element, theirs.begin);
            EXPECT_LE(piece.element + piece.count, theirs.end);
            for (uint64_t k = 0; k < piece.count; ++k) ++covered[piece.to_offset + k];
          }
        }
        EXPECT_EQ(std::count(covered.begin(), covered.end(), 1), static_cast<ptrdiff_t>(owned));
      }
    }
  }
}

}  // namespace
}  // namespace layercast::server::testing
