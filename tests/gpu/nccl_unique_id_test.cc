// The NCCL unique id exchange through a file, and the all-gather split and
// what it can complete: plain host code, so these run (and must pass) on
// machines without a GPU too.

#include "client/gpu/nccl_unique_id.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "client/gpu/nccl_layer_gatherer.h"

namespace layercast::gpu {
namespace {

std::string FreshDir() {
  char dir[] = "/tmp/layercast-nccl-id-XXXXXX";
  EXPECT_NE(::mkdtemp(dir), nullptr);
  return dir;
}

ncclUniqueId Pattern(uint8_t seed) {
  ncclUniqueId id;
  for (size_t i = 0; i < sizeof(id.internal); ++i) {
    id.internal[i] = static_cast<char>(seed + i);
  }
  return id;
}

TEST(NcclUniqueIdTest, WrittenIdReadsBackIdentically) {
  const std::string path = FreshDir() + "/id";
  const ncclUniqueId id = Pattern(7);
  ASSERT_TRUE(WriteNcclUniqueId(path, id).ok());
  absl::StatusOr<ncclUniqueId> read = ReadNcclUniqueId(path, std::chrono::seconds(1));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(std::memcmp(&*read, &id, sizeof(id)), 0);
}

TEST(NcclUniqueIdTest, ReaderWaitsForALateWriter) {
  const std::string path = FreshDir() + "/id";
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(WriteNcclUniqueId(path, Pattern(3)).ok());
  });
  absl::StatusOr<ncclUniqueId> read = ReadNcclUniqueId(path, std::chrono::seconds(10));
  writer.join();
  ASSERT_TRUE(read.ok()) << read.status();
  const ncclUniqueId expected = Pattern(3);
  EXPECT_EQ(std::memcmp(&*read, &expected, sizeof(expected)), 0);
}

TEST(NcclUniqueIdTest, MissingIdIsDeadlineExceededNamingThePath) {
  const std::string path = FreshDir() + "/never";
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<ncclUniqueId> read = ReadNcclUniqueId(path, std::chrono::milliseconds(50));
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(read.status().message().find(path), absl::string_view::npos) << read.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(NcclUniqueIdTest, AFileOfTheWrongSizeIsDataLoss) {
  const std::string path = FreshDir() + "/id";
  std::ofstream(path) << "not an id";
  EXPECT_EQ(ReadNcclUniqueId(path, std::chrono::seconds(1)).status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(NcclUniqueIdTest, RankZeroMakesTheIdTheOthersRead) {
  // ncclGetUniqueId needs no GPU (it names rank 0's bootstrap socket).
  const std::string path = FreshDir() + "/id";
  absl::StatusOr<ncclUniqueId> made = ShareNcclUniqueId(0, path, std::chrono::seconds(1));
  ASSERT_TRUE(made.ok()) << made.status();
  absl::StatusOr<ncclUniqueId> read = ShareNcclUniqueId(1, path, std::chrono::seconds(1));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(std::memcmp(&*made, &*read, sizeof(ncclUniqueId)), 0);
}

TEST(AllGatherSplitTest, EqualAlignedPartsInPlaceInTheAssembledLayout) {
  for (uint64_t total : {256ull, 512ull, 768ull, 256ull * 1000, 256ull * 12345, 256ull * 7}) {
    for (uint32_t k : {1u, 2u, 3u, 4u, 8u}) {
      const AllGatherSplit split = SplitForAllGather(total, k);
      SCOPED_TRACE(testing::Message() << total << " bytes over " << k << " ranks");
      EXPECT_EQ(split.part_bytes % kAssembledAlignment, 0u);
      EXPECT_EQ(split.buffer_bytes, split.part_bytes * k);
      EXPECT_GE(split.buffer_bytes, total);
      EXPECT_LT(split.buffer_bytes - total, k * kAssembledAlignment);
      ASSERT_EQ(split.ranges.size(), k);
      uint64_t next = 0;
      for (uint32_t r = 0; r < k; ++r) {
        const auto [begin, end] = split.ranges[r];
        EXPECT_EQ(begin, next) << "rank " << r;
        EXPECT_LE(begin, end);
        EXPECT_LE(end - begin, split.part_bytes);
        // In place: the part sits where the all-gather puts rank r's bytes.
        if (begin < end) {
          EXPECT_EQ(begin, r * split.part_bytes);
        }
        EXPECT_TRUE(begin % kAssembledAlignment == 0 || begin == total);
        next = end;
      }
      EXPECT_EQ(next, total);
    }
  }
}

TEST(AllGatherSplitTest, RanksRefuseAnFp8LayerTheyCannotCompleteAndOnlyThat) {
  // bf16 bytes [0, 8192), fp8 codes [8192, 12288), their 32 scales from
  // 12288: 12544 bytes, parts of 6400 for two ranks, 4352 for three.
  const LayerSpec spec{"model.layers.3",
                       {TensorSpec{"norm", {4096}, 4096}, TensorSpec{"proj", {64, 64}, 4096}}};
  const AssembledLayout fp8 =
      *AssembledLayout::FromDTypes({DType::kBFloat16, DType::kFloat8E4M3FN}, {4096, 4096}, 128);
  ASSERT_EQ(fp8.total_bytes(), 12544u);
  const AssembledLayout wide =
      *AssembledLayout::FromDTypes({DType::kBFloat16, DType::kFloat32}, {4096, 4096});
  for (uint32_t k : {1u, 2u, 3u, 8u}) EXPECT_TRUE(CheckAllGatherable(4, spec, wide, k).ok()) << k;
  EXPECT_TRUE(CheckAllGatherable(4, spec, fp8, 1).ok());
  EXPECT_TRUE(CheckAllGatherable(4, spec, fp8, 2).ok()) << "rank 1's part holds codes and scales";
  // Three ranks: rank 1 fetches codes [8192, 8704) and receives their scale,
  // which lies in rank 2's part.
  const absl::Status refused = CheckAllGatherable(4, spec, fp8, 3);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find(
                "layer 4 (model.layers.3) has tensor proj in float8_e4m3fn across the parts of 3"),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.message().find("ahead of any other that matches it (the first match wins), "
                                   "e.g. 'proj=bfloat16'"),
            std::string::npos)
      << refused;
  // An fp8 tensor without elements (at byte 8192, the start of rank 1's part
  // of two) has nothing to split.
  const LayerSpec no_codes{"l", {TensorSpec{"norm", {4096}, 4096}, TensorSpec{"proj", {0}, 0}}};
  EXPECT_TRUE(CheckAllGatherable(
                  0, no_codes,
                  *AssembledLayout::FromDTypes({DType::kBFloat16, DType::kFloat8E4M3FN}, {4096, 0}),
                  2)
                  .ok());
}

}  // namespace
}  // namespace layercast::gpu
