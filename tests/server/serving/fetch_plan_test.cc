#include "server/serving/fetch_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/synthetic_model.h"

namespace layercast::server {
namespace {

std::unique_ptr<ParameterStore> Store(uint32_t shard, uint32_t num_shards) {
  auto source = SyntheticModel::Create("llama:layers=1,hidden=48,ffn=80,vocab=30");
  auto store =
      ParameterStore::Load(**source, shard, num_shards, *Policy::Parse("c=bf16;*norm*=f32"));
  EXPECT_TRUE(store.ok()) << store.status();
  return *std::move(store);
}

TEST(FetchPlanTest, PlansExactlyTheOwnedElementsOfTheRange) {
  for (uint32_t num_shards : {1u, 2u, 3u, 7u}) {
    for (uint32_t layer = 0; layer < 3; ++layer) {
      std::vector<uint64_t> covered;
      uint64_t bytes = 0;
      for (uint32_t shard = 0; shard < num_shards; ++shard) {
        auto store = Store(shard, num_shards);
        layercast::v1::FetchLayerRequest request;
        request.set_layer(layer);
        absl::StatusOr<FetchPlan> plan = PlanFetch(*store, request);
        ASSERT_TRUE(plan.ok()) << plan.status();
        covered.resize(store->layout(layer).tensors().size(), 0);
        for (const TensorElementRange& run : plan->runs) {
          EXPECT_EQ(Intersect(run.elements, store->owned(layer, run.tensor)), run.elements);
          covered[run.tensor] += run.elements.size();
        }
        bytes += plan->bytes;
      }
      uint64_t expected_bytes = 0;
      auto store = Store(0, 1);
      for (size_t t = 0; t < covered.size(); ++t) {
        EXPECT_EQ(covered[t], store->layout(layer).tensors()[t].num_elements);
        expected_bytes += store->layout(layer).tensors()[t].num_bytes();
      }
      EXPECT_EQ(bytes, expected_bytes);
    }
  }
}

TEST(FetchPlanTest, RefusesWithTheDocumentedCodes) {
  auto store = Store(0, 2);
  layercast::v1::FetchLayerRequest request;
  request.set_layer(3);
  EXPECT_EQ(PlanFetch(*store, request).status().code(), absl::StatusCode::kNotFound);
  request.set_layer(1);
  request.set_range_end(store->layout(1).total_bytes() + 1);
  EXPECT_EQ(PlanFetch(*store, request).status().code(), absl::StatusCode::kInvalidArgument);
  request.set_range_end(0);
  request.set_expect_dtype(layercast::v1::FLOAT16);
  EXPECT_EQ(PlanFetch(*store, request).status().code(), absl::StatusCode::kFailedPrecondition);
  request.clear_expect_dtype();
  // A delta whose base another start of the shard served: its version may
  // name other values here.
  request.set_base_version(0);
  request.set_base_incarnation(store->incarnation() ^ 1);
  const absl::Status restarted = PlanFetch(*store, request).status();
  EXPECT_EQ(restarted.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(std::string(restarted.message()), ::testing::HasSubstr("earlier start"));
  request.set_base_incarnation(store->incarnation());
  EXPECT_TRUE(PlanFetch(*store, request).ok()) << "the same start: the delta is planned";
  EXPECT_NE(store->incarnation(), Store(0, 2)->incarnation()) << "every load is a new start";
}

TEST(FetchPlanTest, ARequestThatNamesItsDTypeIsPlannedInIt) {
  auto store = Store(1, 2);
  layercast::v1::FetchLayerRequest request;
  request.set_layer(1);
  request.set_dtype(layercast::v1::FLOAT32);
  absl::StatusOr<FetchPlan> plan = PlanFetch(*store, request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->dtype, DType::kFloat32);
  uint64_t elements = 0;
  for (const TensorElementRange& run : plan->runs) {
    EXPECT_EQ(plan->layout.tensors()[run.tensor].compute_dtype, DType::kFloat32);
    EXPECT_EQ(run.elements, store->owned(1, run.tensor));
    elements += run.elements.size();
  }
  EXPECT_EQ(plan->bytes, elements * sizeof(float));
  // A byte range is one of the float32 layout, past the bfloat16 one's end.
  request.set_range_begin(store->layout(1).total_bytes());
  request.set_range_end(plan->layout.total_bytes());
  EXPECT_TRUE(PlanFetch(*store, request).ok());
  request.clear_range_begin();
  request.clear_range_end();

  request.set_base_version(0);
  EXPECT_EQ(PlanFetch(*store, request).status().code(), absl::StatusCode::kOutOfRange)
      << "the change log records the policy's dtypes only";
  request.clear_base_version();
  request.set_dtype(static_cast<layercast::v1::DType>(9));
  EXPECT_EQ(PlanFetch(*store, request).status().code(), absl::StatusCode::kInvalidArgument);
  // fp8 blocks of 128 would straddle the two shards' slices of a 48-wide
  // norm.
  request.set_dtype(layercast::v1::FLOAT8_E4M3FN);
  EXPECT_EQ(PlanFetch(*store, request).status().code(), absl::StatusCode::kFailedPrecondition);
  // The policy's own dtype for every tensor (the embedding's bfloat16) is
  // an ordinary pull.
  request.set_layer(0);
  request.set_dtype(layercast::v1::BFLOAT16);
  plan = PlanFetch(*store, request);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->dtype, std::nullopt);
}

// A slice of 1000 bf16 elements from element 3000, in chunks of 64 bytes:
// 32 elements a chunk from the slice's start, whatever a range asks for.
TEST(ChunkGridTest, CutsTheSliceFromItsFirstElement) {
  const AssembledTensor tensor{.compute_dtype = DType::kBFloat16, .num_elements = 4000};
  const ChunkGrid grid(64, tensor, ElementRange{3000, 4000});
  EXPECT_EQ(grid.chunks(), 32u) << "31 whole chunks and one of 8";
  EXPECT_EQ(grid.ChunkEnd(3000), 3032u);
  EXPECT_EQ(grid.ChunkEnd(3031), 3032u);
  EXPECT_EQ(grid.ChunkEnd(3050), 3064u) << "a ranged stream's first chunk ends on the grid";
  EXPECT_EQ(grid.ChunkEnd(3995), 4000u) << "the last chunk ends with the slice";
  EXPECT_TRUE(grid.IsChunk({3032, 3064}));
  EXPECT_TRUE(grid.IsChunk({3992, 4000}));
  EXPECT_FALSE(grid.IsChunk({3050, 3064})) << "part of a chunk";
  EXPECT_FALSE(grid.IsChunk({3032, 3096})) << "two chunks";
  EXPECT_FALSE(grid.IsChunk({2968, 3000})) << "before the slice";
  EXPECT_FALSE(grid.IsChunk({4000, 4032})) << "after the slice";
  EXPECT_EQ(ChunkGrid(64, tensor, ElementRange{5, 5}).chunks(), 0u) << "an empty slice";
}

// A slice of whole chunks: nothing at or past its end is a chunk, not even
// the empty range where a next chunk would begin.
TEST(ChunkGridTest, NothingPastASliceOfWholeChunksIsAChunk) {
  const AssembledTensor tensor{.compute_dtype = DType::kBFloat16, .num_elements = 4000};
  const ChunkGrid grid(64, tensor, ElementRange{3000, 3064});
  EXPECT_EQ(grid.chunks(), 2u);
  EXPECT_TRUE(grid.IsChunk({3032, 3064}));
  EXPECT_FALSE(grid.IsChunk({3064, 3064})) << "the empty range at the slice's end";
  EXPECT_FALSE(grid.IsChunk({3064, 3096})) << "the chunk after the slice";
}

// An 8-bit float's chunks hold whole blocks and their scales: 100 bytes fit
// two blocks of 32 codes (32 + 4 bytes each, and 8 for the end scales).
TEST(ChunkGridTest, AnEightBitFloatsChunksHoldWholeBlocks) {
  const AssembledTensor tensor{
      .compute_dtype = DType::kFloat8E4M3FN, .num_elements = 256, .block_size = 32};
  const ChunkGrid grid(100, tensor, ElementRange{128, 256});
  EXPECT_EQ(grid.chunks(), 2u);
  EXPECT_EQ(grid.ChunkEnd(128), 192u);
  EXPECT_TRUE(grid.IsChunk({192, 256}));
}

}  // namespace
}  // namespace layercast::server
