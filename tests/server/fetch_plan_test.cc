#include "server/fetch_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/synthetic_model.h"
#include "server/fetch_layer_reactor.h"
#include "server/memory_plan.h"

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

// What the start-up check counts for one stream (MemoryPlan::stream_bytes)
// is at least what any stream then holds: an fp8 chunk's block scales and
// a delta chunk's bitmap included. A shard started with the least budget
// its plan allows must be able to serve every layer.
TEST(FetchPlanTest, AStreamHoldsNoMoreThanTheMemoryPlanCounts) {
  struct Case {
    const char* policy;
    uint32_t num_shards;
    bool deltas;  // 8-bit float layers have none
  };
  const Case cases[] = {{"c=bf16;*norm*=f32", 2, true},
                        {"c=f32", 1, true},
                        {"c=f16", 3, true},
                        {"c=float8_e4m3fn,fp8_block=16;*norm*=bf16", 2, false},
                        {"c=f8e5m2,fp8_block=128", 1, false}};
  auto source = SyntheticModel::Create("llama:layers=1,hidden=48,ffn=80,vocab=30");
  ASSERT_TRUE(source.ok());
  for (const Case& c : cases) {
    for (uint32_t shard = 0; shard < c.num_shards; ++shard) {
      auto store = ParameterStore::Load(**source, shard, c.num_shards, *Policy::Parse(c.policy));
      ASSERT_TRUE(store.ok()) << c.policy << ": " << store.status();
      for (uint64_t chunk_bytes : {300u, 1000u, 4096u, 1u << 20}) {
        for (bool delta : {false, c.deltas}) {
          const absl::StatusOr<MemoryPlan> memory = PlanShardMemory(
              (*source)->model(), shard, c.num_shards, chunk_bytes, delta ? 2 : 0, std::nullopt);
          ASSERT_TRUE(memory.ok()) << memory.status();
          for (uint32_t layer = 0; layer < 3; ++layer) {
            layercast::v1::FetchLayerRequest request;
            request.set_layer(layer);
            const absl::StatusOr<FetchPlan> plan = PlanFetch(**store, request);
            ASSERT_TRUE(plan.ok()) << plan.status();
            EXPECT_LE(FetchLayerReactor::BufferBytes(**store, *plan, chunk_bytes, delta),
                      memory->stream_bytes)
                << c.policy << ", shard " << shard << ", layer " << layer << ", " << chunk_bytes
                << "-byte chunks" << (delta ? ", a delta" : "");
          }
        }
      }
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
}

}  // namespace
}  // namespace layercast::server
