// The device layer stream: a forward-backward walk lands every layer
// bit-identical to the host gather, and the device budget holds both in the
// stream's own accounting and in device memory as cudaMemGetInfo reports it.

#include "client/gpu/device_layer_stream.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "client/gpu/cuda_handles.h"
#include "client/gpu/device_gatherer.h"
#include "client/layer_stream.h"
#include "client/shard_set.h"
#include "tests/client/in_memory_layer_source.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/test_shards.h"

namespace layercast::gpu {
namespace {

// Transformer layers of ~25 MB in bf16: large against the slack below.
constexpr char kModel[] = "llama:layers=6,hidden=1024,ffn=2816,vocab=1000,seed=5";

// Device memory a walk may use beyond its budget as cudaMemGetInfo sees it:
// the stream's pool maps memory in blocks of 32 MiB and more (on an H200 its
// first reservation for a 1 MiB layer was 32 MiB; the walks below, with a
// 49 MiB budget, reserved 64 MiB), plus the driver's own bookkeeping for new
// streams and events.
constexpr uint64_t kSlackBytes = 32ull << 20;

uint64_t DeviceUsedBytes() {
  size_t free = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  return total - free;
}

// Device memory in use above `baseline` (0 if less is in use now).
uint64_t DeviceUsedAbove(uint64_t baseline) {
  const uint64_t used = DeviceUsedBytes();
  return used > baseline ? used - baseline : 0;
}

TEST(DeviceLayerStreamTest, ForwardBackwardWalkIsExactAndWithinTheDeviceBudget) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  TestShards shards(2, kModel);
  auto set = client::ShardSet::Connect(shards.addresses());
  ASSERT_TRUE(set.ok()) << set.status();
  auto gatherer = DeviceGatherer::Create(**set, {.device = 0, .piece_bytes = 4 << 20});
  ASSERT_TRUE(gatherer.ok()) << gatherer.status();

  // The transformer layers only (all one size, so the pool does not fragment),
  // forward then backward.
  const uint32_t n = static_cast<uint32_t>((*set)->model().layers.size());
  std::vector<uint32_t> order;
  for (uint32_t l = 1; l + 1 < n; ++l) order.push_back(l);
  for (uint32_t l = n - 2; l >= 1; --l) order.push_back(l);
  std::map<uint32_t, client::Layer> host;
  for (uint32_t l = 1; l + 1 < n; ++l) {
    auto gathered = (*set)->Gather(l);
    ASSERT_TRUE(gathered.ok()) << gathered.status();
    host.emplace(l, *std::move(gathered));
  }
  const uint64_t layer_bytes = (*gatherer)->DeviceBytes(1);
  DeviceLayerStreamOptions options;
  options.order = order;
  options.budget_bytes = 2 * layer_bytes;

  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t compute = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), cudaSuccess);
  std::vector<uint8_t> back(layer_bytes);
  const uint64_t baseline = DeviceUsedBytes();
  uint64_t peak_used = 0;
  {
    auto stream = DeviceLayerStream::Create(**gatherer, options);
    ASSERT_TRUE(stream.ok()) << stream.status();
    for (uint32_t expected : order) {
      absl::StatusOr<DeviceLayer> layer = (*stream)->Next();
      ASSERT_TRUE(layer.ok()) << layer.status();
      ASSERT_EQ(layer->index(), expected);
      ASSERT_EQ(layer->size(), host.at(expected).bytes().size());
      peak_used = std::max(peak_used, DeviceUsedAbove(baseline));
      // "Compute": the compute stream waits for the layer on the GPU and
      // reads it back; the layer is dropped right after, before the read has
      // run, which RecordUse makes safe.
      ASSERT_TRUE(layer->WaitOn(compute).ok());
      ASSERT_EQ(cudaMemcpyAsync(back.data(), layer->data(), layer->size(), cudaMemcpyDeviceToHost,
                                compute),
                cudaSuccess);
      ASSERT_TRUE(layer->RecordUse(compute).ok());
      const DeviceLayer::TensorView first = layer->tensor(0);
      EXPECT_EQ(first.data, layer->data());
      layer = absl::CancelledError("dropped");  // frees the layer, stream-ordered
      ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
      ASSERT_EQ(std::memcmp(back.data(), host.at(expected).bytes().data(), back.size()), 0)
          << "layer " << expected;
    }
    EXPECT_EQ((*stream)->Next().status().code(), absl::StatusCode::kOutOfRange);
    const DeviceLayerStreamStats stats = (*stream)->stats();
    EXPECT_EQ(stats.layers, order.size());
    EXPECT_LE(stats.peak_bytes, options.budget_bytes);
    EXPECT_LE(stats.pool_reserved_high_bytes, options.budget_bytes + kSlackBytes);
    std::printf(
        "budget %llu bytes; tracked peak %llu; pool reserved high %llu; "
        "cudaMemGetInfo peak above baseline %llu\n",
        static_cast<unsigned long long>(options.budget_bytes),
        static_cast<unsigned long long>(stats.peak_bytes),
        static_cast<unsigned long long>(stats.pool_reserved_high_bytes),
        static_cast<unsigned long long>(peak_used));
  }
  EXPECT_LE(peak_used, options.budget_bytes + kSlackBytes)
      << "device memory in use during the walk, as cudaMemGetInfo reports it";
  cudaStreamDestroy(compute);
}

// Holds the compute stream for a while, as a long kernel would.
void SlowCompute(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(40)); }

TEST(DeviceLayerStreamTest, AHostRunningAheadOfTheGpuStaysWithinTheBudgetOnTheDevice) {
  // As in a training loop: the host enqueues each layer's compute and asks
  // for the next layer at once, never waiting for the GPU (the copies back go
  // to pinned memory, so they do not wait either). The pool must reuse the
  // memory of the frees queued behind that compute: before allocations were
  // ordered after them on the pool's stream, it mapped a fresh block for
  // every layer while the stream's own accounting stayed within the budget
  // (docs/gpu.md, "The device budget").
  LAYERCAST_SKIP_WITHOUT_GPU();
  TestShards shards(2, kModel);
  auto set = client::ShardSet::Connect(shards.addresses());
  ASSERT_TRUE(set.ok()) << set.status();
  auto gatherer = DeviceGatherer::Create(**set, {.device = 0, .piece_bytes = 4 << 20});
  ASSERT_TRUE(gatherer.ok()) << gatherer.status();
  const uint32_t n = static_cast<uint32_t>((*set)->model().layers.size());
  DeviceLayerStreamOptions options;
  for (int pass = 0; pass < 2; ++pass) {
    for (uint32_t l = 1; l + 1 < n; ++l) options.order.push_back(l);
  }
  const uint64_t layer_bytes = (*gatherer)->DeviceBytes(1);
  options.budget_bytes = 2 * layer_bytes;

  std::map<uint32_t, client::Layer> host;
  for (uint32_t l = 1; l + 1 < n; ++l) {
    auto gathered = (*set)->Gather(l);
    ASSERT_TRUE(gathered.ok()) << gathered.status();
    host.emplace(l, *std::move(gathered));
  }

  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  absl::StatusOr<CudaStream> compute_stream = CudaStream::Create();
  ASSERT_TRUE(compute_stream.ok()) << compute_stream.status();
  const cudaStream_t compute = compute_stream->get();
  absl::StatusOr<PinnedBuffer> back = PinnedBuffer::Allocate(options.order.size() * layer_bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  const uint64_t baseline = DeviceUsedBytes();
  uint64_t peak_used = 0;
  {
    auto stream = DeviceLayerStream::Create(**gatherer, options);
    ASSERT_TRUE(stream.ok()) << stream.status();
    for (size_t step = 0; step < options.order.size(); ++step) {
      absl::StatusOr<DeviceLayer> layer = (*stream)->Next();
      ASSERT_TRUE(layer.ok()) << layer.status();
      ASSERT_EQ(layer->size(), layer_bytes);
      peak_used = std::max(peak_used, DeviceUsedAbove(baseline));
      ASSERT_TRUE(layer->WaitOn(compute).ok());
      ASSERT_EQ(cudaLaunchHostFunc(compute, SlowCompute, nullptr), cudaSuccess);
      ASSERT_EQ(cudaMemcpyAsync(back->data() + step * layer_bytes, layer->data(), layer_bytes,
                                cudaMemcpyDeviceToHost, compute),
                cudaSuccess);
      ASSERT_TRUE(layer->RecordUse(compute).ok());
    }
    const DeviceLayerStreamStats stats = (*stream)->stats();
    std::printf("budget %llu bytes; tracked peak %llu; pool used high %llu, reserved high %llu\n",
                static_cast<unsigned long long>(options.budget_bytes),
                static_cast<unsigned long long>(stats.peak_bytes),
                static_cast<unsigned long long>(stats.pool_used_high_bytes),
                static_cast<unsigned long long>(stats.pool_reserved_high_bytes));
    EXPECT_LE(stats.peak_bytes, options.budget_bytes);
    EXPECT_LE(stats.pool_used_high_bytes, options.budget_bytes);
    EXPECT_LE(stats.pool_reserved_high_bytes, options.budget_bytes + kSlackBytes);
  }
  ASSERT_EQ(cudaStreamSynchronize(compute), cudaSuccess);
  EXPECT_LE(peak_used, options.budget_bytes + kSlackBytes)
      << "device memory in use during the walk, as cudaMemGetInfo reports it";
  for (size_t step = 0; step < options.order.size(); ++step) {
    const client::Layer& expected = host.at(options.order[step]);
    ASSERT_EQ(std::memcmp(back->data() + step * layer_bytes, expected.bytes().data(), layer_bytes),
              0)
        << "step " << step << ", layer " << options.order[step];
  }
}

TEST(DeviceLayerStreamTest, HoldingLayersRunsOutOfBudgetWithAClearError) {
  LAYERCAST_SKIP_WITHOUT_GPU();
  TestShards shards(1, "llama:layers=2,hidden=128,ffn=352,vocab=500,seed=1");
  auto set = client::ShardSet::Connect(shards.addresses());
  ASSERT_TRUE(set.ok()) << set.status();
  auto gatherer = DeviceGatherer::Create(**set);
  ASSERT_TRUE(gatherer.ok()) << gatherer.status();
  DeviceLayerStreamOptions options;
  options.order = {1, 2};
  options.budget_bytes = (*gatherer)->DeviceBytes(1);  // one layer; both the same size
  auto stream = DeviceLayerStream::Create(**gatherer, options);
  ASSERT_TRUE(stream.ok()) << stream.status();
  absl::StatusOr<DeviceLayer> held = (*stream)->Next();
  ASSERT_TRUE(held.ok()) << held.status();
  absl::StatusOr<DeviceLayer> next = (*stream)->Next();
  EXPECT_EQ(next.status().code(), absl::StatusCode::kResourceExhausted) << next.status();
}

// A lander that is never asked to land: Create's checks need no device.
class SizesOnlyLander final : public DeviceLander {
 public:
  explicit SizesOnlyLander(const client::LayerSource& source) : source_(source) {}
  const client::LayerSource& source() const override { return source_; }
  int device() const override { return 0; }
  cudaStream_t stream() const override { return nullptr; }
  uint64_t DeviceBytes(uint32_t layer) const override {
    return source_.view().layouts[layer].total_bytes();
  }
  absl::StatusOr<uint64_t> Land(uint32_t, const client::GatherOptions&, void*) override {
    return absl::UnimplementedError("sizes only");
  }

 private:
  const client::LayerSource& source_;
};

TEST(DeviceLayerStreamTest, RefusesALayerLargerThanTheBudgetOrMissing) {
  client::InMemoryLayerSource source("llama:layers=2,hidden=64,ffn=96,vocab=128",
                                     std::chrono::milliseconds(0));
  SizesOnlyLander lander(source);
  DeviceLayerStreamOptions options;
  options.order = {0, 1};
  options.budget_bytes = lander.DeviceBytes(1) - 1;
  auto stream = DeviceLayerStream::Create(lander, options);
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kResourceExhausted) << stream.status();
  options.order = {7};
  options.budget_bytes = 1ull << 30;
  stream = DeviceLayerStream::Create(lander, options);
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kNotFound) << stream.status();
}

}  // namespace
}  // namespace layercast::gpu
