// Landing layers on the device through pinned staging: the device bytes are
// bit-identical to the host gather of the same layer from the same shard
// servers (two in-process shards on 127.0.0.1), with pieces small enough that
// every layer takes many pieces and back-to-back landings reuse the staging.

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "client/gpu/device_gatherer.h"
#include "client/shard_set.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/test_shards.h"

namespace layercast::gpu {
namespace {

constexpr char kModel[] = "llama:layers=3,hidden=256,ffn=704,vocab=1000,seed=9";

// Lands every layer of shards serving `policy` and compares each with the
// host gather; `compute` is the dtype the policy gives the weight matrices.
void ExpectLandingsBitIdentical(const std::string& policy, DType compute) {
  TestShards shards(2, kModel, policy);
  auto set = client::ShardSet::Connect(shards.addresses());
  ASSERT_TRUE(set.ok()) << set.status();
  const auto& tensors = (*set)->view().layouts[1].tensors();
  ASSERT_TRUE(
      std::any_of(tensors.begin(), tensors.end(),
                  [compute](const AssembledTensor& t) { return t.compute_dtype == compute; }))
      << "the policy " << policy << " gave no tensor of layer 1 the dtype expected";
  DeviceGathererOptions options;
  options.piece_bytes = 64 << 10;  // ~20 pieces per layer
  auto gatherer = DeviceGatherer::Create(**set, options);
  ASSERT_TRUE(gatherer.ok()) << gatherer.status();
  EXPECT_EQ(ExpectLandingsMatchHost(**set, **gatherer), absl::OkStatus());
}

TEST(DeviceGathererTest, LandedBytesAreBitIdenticalToTheHostGather) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  ExpectLandingsBitIdentical(kTestPolicy, DType::kBFloat16);
}

TEST(DeviceGathererTest, LandedF16BytesAreBitIdenticalToTheHostGather) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  ExpectLandingsBitIdentical("c=f16;*norm*=f32", DType::kFloat16);
}

TEST(DeviceGathererTest, BackToBackLandingsPipelineThroughTheStagingSafely) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  TestShards shards(2, kModel);
  auto set = client::ShardSet::Connect(shards.addresses());
  ASSERT_TRUE(set.ok()) << set.status();
  DeviceGathererOptions options;
  options.piece_bytes = 48 << 10;
  auto gatherer = DeviceGatherer::Create(**set, options);
  ASSERT_TRUE(gatherer.ok()) << gatherer.status();

  // Land every layer twice without waiting in between: staging bytes are
  // overwritten while earlier copies may still be reading them.
  const uint32_t n = static_cast<uint32_t>((*set)->model().layers.size());
  std::vector<void*> device;
  for (uint32_t round = 0; round < 2; ++round) {
    for (uint32_t layer = 0; layer < n; ++layer) {
      void* dst = nullptr;
      ASSERT_EQ(cudaMalloc(&dst, (*gatherer)->DeviceBytes(layer)), cudaSuccess);
      device.push_back(dst);
      absl::StatusOr<uint64_t> version = (*gatherer)->Land(layer, {}, dst);
      ASSERT_TRUE(version.ok()) << version.status();
    }
  }
  ASSERT_EQ(cudaStreamSynchronize((*gatherer)->stream()), cudaSuccess);
  for (size_t i = 0; i < device.size(); ++i) {
    const uint32_t layer = static_cast<uint32_t>(i % n);
    auto host = (*set)->Gather(layer);
    ASSERT_TRUE(host.ok()) << host.status();
    const absl::Status same = ExpectDeviceBytes(device[i], host->bytes(), "layer");
    EXPECT_TRUE(same.ok()) << "landing " << i << ": " << same;
    cudaFree(device[i]);
  }
}

TEST(DeviceGathererTest, LandsAByteRangeAtTheStartOfTheDestination) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  TestShards shards(2, kModel);
  auto set = client::ShardSet::Connect(shards.addresses());
  ASSERT_TRUE(set.ok()) << set.status();
  auto gatherer = DeviceGatherer::Create(**set, {.device = 0, .piece_bytes = 64 << 10});
  ASSERT_TRUE(gatherer.ok()) << gatherer.status();
  const uint32_t layer = 1;
  const auto ranges = (*set)->view().layouts[layer].SplitBytes(3);
  const auto [begin, end] = ranges[1];
  void* dst = nullptr;
  ASSERT_EQ(cudaMalloc(&dst, end - begin), cudaSuccess);
  absl::StatusOr<uint64_t> version = (*gatherer)->LandRange(layer, {}, begin, end, dst);
  ASSERT_TRUE(version.ok()) << version.status();
  ASSERT_EQ(cudaStreamSynchronize((*gatherer)->stream()), cudaSuccess);
  auto host = (*set)->Gather(layer);
  ASSERT_TRUE(host.ok()) << host.status();
  const absl::Status same = ExpectDeviceBytes(dst, host->bytes().subspan(begin, end - begin),
                                              "the middle third of layer 1");
  EXPECT_TRUE(same.ok()) << same;
  cudaFree(dst);
}

TEST(DeviceGathererTest, RefusesARangeThatIsEmptyOrNotAligned) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  TestShards shards(1, kModel);
  auto set = client::ShardSet::Connect(shards.addresses());
  ASSERT_TRUE(set.ok()) << set.status();
  auto gatherer = DeviceGatherer::Create(**set);
  ASSERT_TRUE(gatherer.ok()) << gatherer.status();
  void* dst = nullptr;
  ASSERT_EQ(cudaMalloc(&dst, 4096), cudaSuccess);
  EXPECT_EQ((*gatherer)->LandRange(0, {}, 256, 256, dst).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*gatherer)->LandRange(0, {}, 0, 100, dst).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*gatherer)->Land(99, {}, dst).status().code(), absl::StatusCode::kNotFound);
  cudaFree(dst);
}

TEST(DeviceGathererTest, NamesAMissingDevice) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  TestShards shards(1, kModel);
  auto set = client::ShardSet::Connect(shards.addresses());
  ASSERT_TRUE(set.ok()) << set.status();
  auto gatherer = DeviceGatherer::Create(**set, {.device = 1000});
  EXPECT_EQ(gatherer.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace layercast::gpu
