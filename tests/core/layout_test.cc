#include "core/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

namespace layercast {
namespace {

using ::testing::HasSubstr;

const uint64_t kAwkwardSizes[] = {0, 1, 2, 3, 5, 7, 31, 63, 64, 65, 97, 127, 1000, 4099, 65537};

TEST(ShardElementRangeTest, EveryElementOwnedByExactlyOneShard) {
  for (uint32_t num_shards = 1; num_shards <= 64; ++num_shards) {
    for (uint64_t n : kAwkwardSizes) {
      std::vector<int> owners(n, 0);
      uint64_t smallest = n, largest = 0;
      for (uint32_t shard = 0; shard < num_shards; ++shard) {
        const ElementRange range = ShardElementRange(n, shard, num_shards);
        ASSERT_LE(range.begin, range.end);
        ASSERT_LE(range.end, n);
        for (uint64_t i = range.begin; i < range.end; ++i) ++owners[i];
        smallest = std::min(smallest, range.size());
        largest = std::max(largest, range.size());
      }
      for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(owners[i], 1) << "n=" << n << " N=" << num_shards;
      EXPECT_LE(largest - smallest, 1u) << "balanced to one element: n=" << n;
    }
  }
  EXPECT_EQ(ShardElementRange(10, 1, 3), (ElementRange{3, 6}));
}

TEST(ShardElementRangeTest, NoOverflowOnHugeTensors) {
  const uint64_t n = uint64_t{1} << 62;
  EXPECT_EQ(ShardElementRange(n, 63, 64).end, n);
  EXPECT_EQ(ShardElementRange(n, 1, 4).begin, n / 4);
}

AssembledLayout MixedLayout() {
  return *AssembledLayout::FromDTypes(
      {DType::kBFloat16, DType::kFloat32, DType::kFloat16, DType::kBFloat16}, {1000, 3, 128, 1});
}

TEST(AssembledLayoutTest, TensorsAlignedAndNonOverlapping) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<DType> dtypes;
    std::vector<uint64_t> counts;
    const int tensors = 1 + static_cast<int>(rng() % 12);
    for (int t = 0; t < tensors; ++t) {
      dtypes.push_back(static_cast<DType>(1 + rng() % 3));
      counts.push_back(rng() % 5000);
    }
    const AssembledLayout layout = *AssembledLayout::FromDTypes(dtypes, counts);
    uint64_t previous_end = 0;
    for (const AssembledTensor& t : layout.tensors()) {
      EXPECT_EQ(t.byte_offset % kAssembledAlignment, 0u);
      EXPECT_GE(t.byte_offset, previous_end);
      EXPECT_LT(t.byte_offset - previous_end, kAssembledAlignment);
      previous_end = t.byte_offset + t.num_bytes();
    }
    EXPECT_GE(layout.total_bytes(), previous_end);
    EXPECT_EQ(layout.total_bytes() % kAssembledAlignment, 0u);
  }
  const AssembledLayout layout = MixedLayout();
  EXPECT_EQ(layout.tensors()[1].byte_offset, 2048u);  // 2000 bytes of bf16, aligned up
  EXPECT_EQ(layout.total_bytes(), 2048u + 256 + 256 + 256);
}

TEST(AssembledLayoutTest, SplitRangesTileEveryTensorExactlyOnce) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<DType> dtypes;
    std::vector<uint64_t> counts;
    const int tensors = 1 + static_cast<int>(rng() % 6);
    for (int t = 0; t < tensors; ++t) {
      dtypes.push_back(static_cast<DType>(1 + rng() % 3));
      counts.push_back(1 + rng() % 3000);
    }
    const AssembledLayout layout = *AssembledLayout::FromDTypes(dtypes, counts);
    for (uint32_t parts : {1u, 2u, 3u, 8u, 64u}) {
      std::vector<std::vector<int>> seen(tensors);
      for (int t = 0; t < tensors; ++t) seen[t].assign(counts[t], 0);
      uint64_t expected_begin = 0;
      for (auto [begin, end] : layout.SplitBytes(parts)) {
        ASSERT_EQ(begin, expected_begin);
        expected_begin = end;
        if (begin == end) continue;
        absl::StatusOr<std::vector<TensorElementRange>> ranges = layout.MapByteRange(begin, end);
        ASSERT_TRUE(ranges.ok()) << ranges.status();
        for (const TensorElementRange& r : *ranges) {
          for (uint64_t i = r.elements.begin; i < r.elements.end; ++i) ++seen[r.tensor][i];
        }
      }
      ASSERT_EQ(expected_begin, layout.total_bytes());
      for (int t = 0; t < tensors; ++t) {
        for (uint64_t i = 0; i < counts[t]; ++i) ASSERT_EQ(seen[t][i], 1);
      }
    }
  }
}

TEST(AssembledLayoutTest, RefusesALayerWhoseSizeWouldWrap) {
  // 16384 fp32 tensors of 2^48 elements and one more element: 2^64 + 4 bytes,
  // which unchecked arithmetic wrapped to a 256-byte layer whose tensor 0 was
  // a 2^50-byte span.
  std::vector<DType> dtypes(16385, DType::kFloat32);
  std::vector<uint64_t> counts(16384, uint64_t{1} << 48);
  counts.push_back(1);
  const absl::Status status = AssembledLayout::FromDTypes(dtypes, counts).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("tensor 0 of 16385 has 281474976710656 float32 elements, "
                        "1125899906842624 bytes (1.00 PiB), more than the most one layer may "
                        "assemble to, 281474976710656 bytes (256.00 TiB)"));
  // A product past 2^64 on its own.
  EXPECT_THAT(
      AssembledLayout::FromDTypes({DType::kFloat32}, {uint64_t{1} << 62}).status().message(),
      HasSubstr("more than 2^64 bytes"));
}

TEST(AssembledLayoutTest, RefusesALayerOverTheCapAndAcceptsOneAtIt) {
  // bf16 tensors of 2^47 elements are 2^48 bytes each: one is exactly the cap.
  const uint64_t n = uint64_t{1} << 47;
  absl::StatusOr<AssembledLayout> at_cap = AssembledLayout::FromDTypes({DType::kBFloat16}, {n});
  ASSERT_TRUE(at_cap.ok()) << at_cap.status();
  EXPECT_EQ(at_cap->total_bytes(), kMaxAssembledLayerBytes);
  // A second tensor, however small, takes the aligned end past it.
  const absl::Status status =
      AssembledLayout::FromDTypes({DType::kBFloat16, DType::kFloat16}, {n, 1}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("tensors 0-1 of 2 take 281474976710912 bytes (256.00 TiB) (tensor 1 "
                        "adds 2 bytes at offset 281474976710656), more than the most one layer"));
  // Unaligned ends near the cap round up to it, not past it.
  at_cap = AssembledLayout::FromDTypes({DType::kFloat32, DType::kFloat16},
                                       {(kMaxAssembledLayerBytes - 512) / 4, 3});
  ASSERT_TRUE(at_cap.ok()) << at_cap.status();
  EXPECT_EQ(at_cap->total_bytes(), kMaxAssembledLayerBytes - 256);
  const AssembledTensor& last = at_cap->tensors()[1];
  EXPECT_LE(last.byte_offset + last.num_bytes(), at_cap->total_bytes());
  EXPECT_EQ(AssembledLayout::FromDTypes({DType::kFloat32}, {1, 2}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(AssembledLayoutTest, BuildNamesTheLayer) {
  const LayerSpec layer{"model.layers.7", {TensorSpec{"w", {}, uint64_t{1} << 47}}};
  EXPECT_TRUE(AssembledLayout::Build(layer, *Policy::Parse("c=bf16")).ok());
  const absl::Status status = AssembledLayout::Build(layer, *Policy::Parse("c=f32")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("layer model.layers.7: tensor 0 of 1 has"));
}

TEST(AssembledLayoutTest, MapByteRangeSelectsElements) {
  const AssembledLayout layout = MixedLayout();
  absl::StatusOr<std::vector<TensorElementRange>> ranges = layout.MapByteRange(1000, 2052);
  ASSERT_TRUE(ranges.ok()) << ranges.status();
  ASSERT_EQ(ranges->size(), 2u);
  EXPECT_EQ((*ranges)[0].tensor, 0u);
  EXPECT_EQ((*ranges)[0].elements, (ElementRange{500, 1000}));
  EXPECT_EQ((*ranges)[1].tensor, 1u);
  EXPECT_EQ((*ranges)[1].elements, (ElementRange{0, 1}));
  // Padding only: valid, selects nothing.
  ranges = layout.MapByteRange(2000, 2048);
  ASSERT_TRUE(ranges.ok());
  EXPECT_TRUE(ranges->empty());
}

TEST(AssembledLayoutTest, MapByteRangeRefusesBadRanges) {
  const AssembledLayout layout = MixedLayout();
  EXPECT_THAT(layout.MapByteRange(0, 0).status().message(), HasSubstr("non-empty"));
  EXPECT_EQ(layout.MapByteRange(10, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(layout.MapByteRange(0, layout.total_bytes() + 256).status().message(),
              HasSubstr("assembled size of 2816 bytes"));
  // Byte 2050 is inside the first fp32 element of tensor 1.
  absl::Status split = layout.MapByteRange(2050, 2056).status();
  EXPECT_EQ(split.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(split.message(), HasSubstr("byte 2050 falls inside a float32 element of tensor 1"));
  EXPECT_EQ(layout.MapByteRange(1, 4).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LayoutDigestTest, ChangesWithAnythingThatMovesBytes) {
  ModelSpec model{
      "m", {LayerSpec{"l0", {TensorSpec{"a.weight", {4, 8}, 32}, TensorSpec{"a.norm", {8}, 8}}}}};
  const Policy bf16 = *Policy::Parse("c=bf16");
  const auto base = *LayoutDigest(model, bf16);
  EXPECT_EQ(base, *LayoutDigest(model, bf16));
  EXPECT_NE(base, *LayoutDigest(model, *Policy::Parse("c=bf16;*norm=f32")));
  EXPECT_NE(base, *LayoutDigest(model, *Policy::Parse("c=f32")));
  ModelSpec reshaped = model;
  reshaped.layers[0].tensors[0].shape = {8, 4};
  EXPECT_NE(base, *LayoutDigest(reshaped, bf16));
  ModelSpec renamed = model;
  renamed.layers[0].tensors[1].name = "a.norm2";
  EXPECT_NE(base, *LayoutDigest(renamed, bf16));
}

TEST(LayoutDigestTest, ALayerThatCannotBeLaidOutHasNoDigest) {
  const ModelSpec model{"m", {LayerSpec{"huge", {TensorSpec{"w", {}, uint64_t{1} << 62}}}}};
  const absl::Status status = LayoutDigest(model, *Policy::Parse("c=f32")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("layer huge: tensor 0 of 1 has 4611686018427387904 "
                                          "float32 elements, more than 2^64 bytes"));
}

TEST(AssembledLayoutTest, Float8TensorsKeepTheirBlockScalesAfterTheirCodes) {
  const AssembledLayout layout = *AssembledLayout::FromDTypes(
      {DType::kFloat8E4M3FN, DType::kBFloat16, DType::kFloat8E5M2}, {1000, 3, 4096}, 32);
  const auto& t = layout.tensors();
  EXPECT_EQ(t[0].byte_offset, 0u);
  EXPECT_EQ(t[0].block_size, 32u);
  EXPECT_EQ(t[0].num_blocks(), 32u);  // ceil(1000 / 32)
  EXPECT_EQ(t[0].scale_offset, 1024u);
  EXPECT_EQ(t[1].byte_offset, 1024u + 256u);  // after 128 bytes of scales, aligned
  EXPECT_EQ(t[1].block_size, 0u);
  EXPECT_EQ(t[1].scale_bytes(), 0u);
  EXPECT_EQ(t[2].byte_offset, 1536u);
  EXPECT_EQ(t[2].scale_offset, 1536u + 4096u);
  EXPECT_EQ(layout.total_bytes(), 1536u + 4096u + 512u);
  // Scales are not elements: a range over them selects nothing, and one
  // over codes selects exactly those.
  EXPECT_TRUE(layout.MapByteRange(1024, 1280)->empty());
  const auto selected = *layout.MapByteRange(37, 1280);
  ASSERT_EQ(selected.size(), 1u);
  EXPECT_EQ(selected[0].elements, (ElementRange{37, 1000}));
  // A block size the policy grammar does not allow is refused, naming it.
  const absl::StatusOr<AssembledLayout> bad =
      AssembledLayout::FromDTypes({DType::kFloat8E5M2}, {64}, 48);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("tensor 0 is float8_e5m2 with blocks of 48 elements; a block is a power "
                        "of two from 16 to 256"));
}

TEST(GradientLayoutTest, Float8TensorsTakeTheirGradientsInFloat32WithoutScales) {
  const AssembledLayout served = *AssembledLayout::FromDTypes(
      {DType::kFloat8E4M3FN, DType::kBFloat16, DType::kFloat8E5M2, DType::kFloat16},
      {1000, 3, 4096, 7}, 32);
  const AssembledLayout gradient = *GradientLayout(served);
  const auto& t = gradient.tensors();
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[0].compute_dtype, DType::kFloat32);
  EXPECT_EQ(t[0].block_size, 0u);
  EXPECT_EQ(t[0].scale_bytes(), 0u);
  EXPECT_EQ(t[0].byte_offset, 0u);
  EXPECT_EQ(t[1].compute_dtype, DType::kBFloat16);
  EXPECT_EQ(t[1].byte_offset, 4096u);  // 4000 bytes of float32, aligned
  EXPECT_EQ(t[2].compute_dtype, DType::kFloat32);
  EXPECT_EQ(t[2].byte_offset, 4352u);
  EXPECT_EQ(t[3].compute_dtype, DType::kFloat16);
  EXPECT_EQ(t[3].byte_offset, 4352u + 16384u);
  EXPECT_EQ(gradient.total_bytes(), 4352u + 16384u + 256u);
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(t[i].num_elements, served.tensors()[i].num_elements) << i;
  }

  // Without 8-bit tensors the gradient comes in the gather's own layout.
  const AssembledLayout wide =
      *AssembledLayout::FromDTypes({DType::kBFloat16, DType::kFloat32}, {1000, 3});
  const AssembledLayout same = *GradientLayout(wide);
  EXPECT_EQ(same.total_bytes(), wide.total_bytes());
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(same.tensors()[i].compute_dtype, wide.tensors()[i].compute_dtype);
    EXPECT_EQ(same.tensors()[i].byte_offset, wide.tensors()[i].byte_offset);
  }

  // Four bytes an element where the codes took one: a layer at the cap in
  // fp8 cannot take its gradient, and says so.
  const AssembledLayout at_cap =
      *AssembledLayout::FromDTypes({DType::kFloat8E4M3FN}, {kMaxAssembledLayerBytes / 2}, 256);
  const absl::Status too_big = GradientLayout(at_cap).status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_big.message()), HasSubstr("float32 elements"));
}

TEST(AssembledLayoutTest, ShardsMayNotSplitAFloat8Block) {
  const LayerSpec layer{"l0", {TensorSpec{"w", {64, 8}, 512}, TensorSpec{"b", {24}, 24}}};
  const AssembledLayout layout =
      *AssembledLayout::Build(layer, *Policy::Parse("c=f8e4m3,fp8_block=16;b=bf16"));
  for (uint32_t shards : {1u, 2u, 4u, 8u, 16u, 32u}) {
    EXPECT_TRUE(CheckBlocksWithinShards(layer, layout, shards).ok()) << shards;
  }
  const absl::Status three = CheckBlocksWithinShards(layer, layout, 3);
  EXPECT_EQ(three.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(three.message()),
              HasSubstr("tensor w (512 elements) is float8_e4m3fn in blocks of 16, but shard 1 of "
                        "3 would start at element 170, inside a block"));
  // The 16-bit tensor may be cut anywhere.
  const AssembledLayout all_fp8 =
      *AssembledLayout::Build(layer, *Policy::Parse("c=f8e4m3,fp8_block=16"));
  EXPECT_THAT(std::string(CheckBlocksWithinShards(layer, all_fp8, 2).message()),
              HasSubstr("tensor b (24 elements)"));
}

TEST(LayoutDigestTest, ChangesWithTheFloat8BlockSize) {
  ModelSpec model{"m", {LayerSpec{"l0", {TensorSpec{"a.weight", {4, 64}, 256}}}}};
  const auto block32 = *LayoutDigest(model, *Policy::Parse("c=f8e4m3,fp8_block=32"));
  EXPECT_NE(block32, *LayoutDigest(model, *Policy::Parse("c=f8e4m3,fp8_block=64")));
  EXPECT_NE(block32, *LayoutDigest(model, *Policy::Parse("c=f8e5m2,fp8_block=32")));
  // A block size no fp8 tensor uses moves nothing.
  EXPECT_EQ(*LayoutDigest(model, *Policy::Parse("c=bf16")),
            *LayoutDigest(model, *Policy::Parse("c=bf16,fp8_block=32")));
}

}  // namespace
}  // namespace layercast
