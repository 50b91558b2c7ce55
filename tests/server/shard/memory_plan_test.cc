#include "server/shard/memory_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>

#include "core/synthetic_model.h"
#include "server/serving/fetch_plan.h"
#include "server/serving/parameter_store.h"

namespace layercast::server {
namespace {

// What the start-up check counts for one stream (MemoryPlan::stream_bytes)
// is at least what any stream then holds: an fp8 chunk's block scales and
// a delta chunk's bitmap included, from the least --chunk-bytes the shard
// accepts. A shard started with the least budget its plan allows must be
// able to serve every layer.
TEST(MemoryPlanTest, AStreamHoldsNoMoreThanThePlanCounts) {
  struct Case {
    const char* policy;
    uint32_t num_shards;
    bool deltas;                 // 8-bit float layers have none
    uint64_t least_chunk_bytes;  // ResolveShardConfig's floor
  };
  const Case cases[] = {
      {"c=bf16;*norm*=f32", 2, true, 4},
      {"c=f32", 1, true, 4},
      {"c=f16", 3, true, 4},
      {"c=float8_e4m3fn,fp8_block=16;*norm*=bf16", 2, false, LeastFp8ChunkBytes(16)},
      {"c=f8e5m2,fp8_block=128", 1, false, LeastFp8ChunkBytes(128)}};
  auto source = SyntheticModel::Create("llama:layers=1,hidden=48,ffn=80,vocab=30");
  ASSERT_TRUE(source.ok());
  for (const Case& c : cases) {
    for (uint32_t shard = 0; shard < c.num_shards; ++shard) {
      auto store = ParameterStore::Load(**source, shard, c.num_shards, *Policy::Parse(c.policy));
      ASSERT_TRUE(store.ok()) << c.policy << ": " << store.status();
      for (uint64_t chunk_bytes : {c.least_chunk_bytes, uint64_t{300}, uint64_t{1000},
                                   uint64_t{4096}, uint64_t{1} << 20}) {
        for (bool delta : {false, true}) {
          if (delta && !c.deltas) continue;
          const absl::StatusOr<MemoryPlan> memory =
              PlanShardMemory((*source)->model(), *Policy::Parse(c.policy), shard, c.num_shards,
                              chunk_bytes, delta ? 2 : 0, std::nullopt);
          ASSERT_TRUE(memory.ok()) << memory.status();
          for (uint32_t layer = 0; layer < 3; ++layer) {
            layercast::v1::FetchLayerRequest request;
            request.set_layer(layer);
            const absl::StatusOr<FetchPlan> plan = PlanFetch(**store, request);
            ASSERT_TRUE(plan.ok()) << plan.status();
            EXPECT_LE(StreamBufferBytes(*plan, chunk_bytes, delta), memory->stream_bytes)
                << c.policy << ", shard " << shard << ", layer " << layer << ", " << chunk_bytes
                << "-byte chunks" << (delta ? ", a delta" : "");
          }
        }
      }
    }
  }
}

// Tiny chunks make a large grid, and its cast-error ledger a large part of
// what a shard holds: the plan counts it, and a budget with room for the
// master and a stream but not the ledger is refused, naming it and the way
// out (larger chunks).
TEST(MemoryPlanTest, ABudgetWithoutRoomForTheLedgerIsRefused) {
  auto source = SyntheticModel::Create("llama:layers=1,hidden=64,ffn=128,vocab=512");
  ASSERT_TRUE(source.ok());
  const Policy policy = *Policy::Parse("c=bf16");
  const absl::StatusOr<MemoryPlan> tiny =
      PlanShardMemory((*source)->model(), policy, 0, 1, 4, 0, std::nullopt);
  const absl::StatusOr<MemoryPlan> large =
      PlanShardMemory((*source)->model(), policy, 0, 1, 1 << 20, 0, std::nullopt);
  ASSERT_TRUE(tiny.ok() && large.ok());
  // Two bf16 elements a chunk, a tensor's last one perhaps one.
  uint64_t chunks = 0;
  for (const LayerSpec& layer : (*source)->model().layers) {
    for (const TensorSpec& tensor : layer.tensors) chunks += (tensor.num_elements + 1) / 2;
  }
  EXPECT_EQ(tiny->grid_chunks, chunks);
  EXPECT_GT(tiny->ledger_bytes, tiny->master_bytes) << "a record per two elements";
  EXPECT_EQ(tiny->MinimumBudget(), tiny->master_bytes + tiny->stream_bytes + tiny->ledger_bytes);
  EXPECT_LT(large->ledger_bytes, 64u << 10);

  const absl::Status refused =
      CheckPlanFits(*tiny, std::nullopt, tiny->master_bytes + 4 * tiny->stream_bytes);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.message()),
              ::testing::AllOf(::testing::HasSubstr("for the cast-error ledger"),
                               ::testing::HasSubstr("raise the budget or --chunk-bytes")));
  EXPECT_EQ(CheckPlanFits(*tiny, std::nullopt, tiny->MinimumBudget()), absl::OkStatus());
  EXPECT_FALSE(CheckPlanFits(*tiny, std::nullopt, tiny->MinimumBudget() - 1).ok());
}

}  // namespace
}  // namespace layercast::server
