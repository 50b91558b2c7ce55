// The prefetch scheduler against both landings: LayerStream's host landing,
// and a device landing whose frees complete later, as a GPU's stream-ordered
// frees do (tests/client/fake_device_landing.h), so the GPU path's scheduling
// is tested without a GPU. Order, budget, look-ahead, stuck detection,
// cancellation on destruction. Runs under ThreadSanitizer in CI.

#include "client/layer_stream.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/client/fake_device_landing.h"
#include "tests/client/in_memory_layer_source.h"

namespace layercast::client {
namespace {

using ::testing::HasSubstr;

constexpr char kSpec[] = "llama:layers=4,hidden=64,ffn=96,vocab=128";

uint64_t LargestLayer(const LayerSource& source) {
  uint64_t largest = 0;
  for (const AssembledLayout& layout : source.view().layouts) {
    largest = std::max(largest, layout.total_bytes());
  }
  return largest;
}

// The host landing, as a worker gets it.
struct HostLandingStreams {
  using LayerT = Layer;
  static absl::StatusOr<std::unique_ptr<LayerStream>> Create(const LayerSource& source,
                                                             PrefetchOptions options) {
    return LayerStream::Create(source, std::move(options));
  }
};

// The device landing's scheduling: frees that complete 3 ms after the drop.
struct DeviceLandingStreams {
  using LayerT = FakeDeviceLayer;
  static absl::StatusOr<std::unique_ptr<FakeDeviceStream>> Create(const LayerSource& source,
                                                                  PrefetchOptions options) {
    return FakeDeviceStream::Create(source, std::move(options), std::chrono::milliseconds(3));
  }
};

template <typename Streams>
class PrefetchSchedulerTest : public ::testing::Test {};
using Landings = ::testing::Types<HostLandingStreams, DeviceLandingStreams>;
TYPED_TEST_SUITE(PrefetchSchedulerTest, Landings);

TYPED_TEST(PrefetchSchedulerTest, HandsOutTheDeclaredOrderWithinTheBudget) {
  InMemoryLayerSource source(kSpec, std::chrono::milliseconds(2));
  const uint32_t n = static_cast<uint32_t>(source.view().layouts.size());
  for (uint64_t budget_layers : {1, 2, 3, 100}) {
    PrefetchOptions options;
    options.order = ForwardBackwardOrder(n);
    options.budget_bytes = budget_layers * LargestLayer(source);
    auto stream = TypeParam::Create(source, options);
    ASSERT_TRUE(stream.ok()) << stream.status();
    for (uint32_t expected : options.order) {
      auto layer = (*stream)->Next();
      ASSERT_TRUE(layer.ok()) << layer.status();
      EXPECT_EQ(layer->index(), expected);
      EXPECT_EQ(layer->bytes().size(), source.view().layouts[expected].total_bytes());
    }
    EXPECT_EQ((*stream)->Next().status().code(), absl::StatusCode::kOutOfRange);
    const PrefetchStats stats = (*stream)->stats();
    EXPECT_EQ(stats.layers, options.order.size());
    EXPECT_LE(stats.peak_bytes, options.budget_bytes) << budget_layers << " layers of budget";
  }
}

TYPED_TEST(PrefetchSchedulerTest, PrefetchesWhileTheCallerComputes) {
  InMemoryLayerSource source(kSpec, std::chrono::milliseconds(5));
  const uint32_t n = static_cast<uint32_t>(source.view().layouts.size());
  PrefetchOptions options;
  options.order = ForwardOrder(n);
  options.budget_bytes = 3 * LargestLayer(source);
  auto stream = TypeParam::Create(source, options);
  ASSERT_TRUE(stream.ok());
  for (uint32_t i = 0; i < n; ++i) {
    auto layer = (*stream)->Next();
    ASSERT_TRUE(layer.ok());
    // "Compute" until the next layer has landed behind it: an event, not a
    // window (bounded: 5 ms gathers, 10 s at most).
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((*stream)->stats().landed < std::min(i + 2, n) &&
           std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_GE((*stream)->stats().landed, std::min(i + 2, n))
        << "layer " << i + 1 << " never landed";
  }
  const PrefetchStats stats = (*stream)->stats();
  EXPECT_GE(stats.hits, n - 1) << "every layer after the first landed while the caller computed";
}

TYPED_TEST(PrefetchSchedulerTest, ZeroLookaheadFetchesOnlyOnDemand) {
  InMemoryLayerSource source(kSpec, std::chrono::milliseconds(5));
  const uint32_t n = static_cast<uint32_t>(source.view().layouts.size());
  PrefetchOptions options;
  options.order = ForwardOrder(n);
  options.budget_bytes = 100 * LargestLayer(source);
  options.max_lookahead = 0;
  auto stream = TypeParam::Create(source, options);
  ASSERT_TRUE(stream.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(source.gathers(), 0) << "nothing fetched before it was asked for";
  for (uint32_t i = 0; i < n; ++i) {
    ASSERT_TRUE((*stream)->Next().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(source.gathers(), static_cast<int>(i + 1));
  }
  EXPECT_EQ((*stream)->stats().misses, n);
}

TYPED_TEST(PrefetchSchedulerTest, RefusesALayerLargerThanTheBudgetUpFront) {
  InMemoryLayerSource source(kSpec, std::chrono::milliseconds(0));
  PrefetchOptions options;
  options.order = {0, 1};
  options.budget_bytes = LargestLayer(source) - 1;
  auto stream = TypeParam::Create(source, options);
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(stream.status().message()), HasSubstr("more than the stream's budget"));
  options.order = {0, 99};
  options.budget_bytes = 100 * LargestLayer(source);
  EXPECT_EQ(TypeParam::Create(source, options).status().code(), absl::StatusCode::kNotFound);
}

TYPED_TEST(PrefetchSchedulerTest, ACallerHoldingTheWholeBudgetGetsAnErrorNotAHang) {
  InMemoryLayerSource source(kSpec, std::chrono::milliseconds(0));
  PrefetchOptions options;
  options.order = {1, 2, 3};
  options.budget_bytes = source.view().layouts[1].total_bytes() + 10;
  auto stream = TypeParam::Create(source, options);
  ASSERT_TRUE(stream.ok());
  auto held = (*stream)->Next();
  ASSERT_TRUE(held.ok());
  auto next = (*stream)->Next();
  EXPECT_EQ(next.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(next.status().message()), HasSubstr("drop a layer"));
  held = absl::CancelledError("dropped");  // returns its bytes
  auto after = (*stream)->Next();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->index(), 2u);
}

TYPED_TEST(PrefetchSchedulerTest, DestroyingMidwayCancelsAndKeepsHandedOutLayers) {
  // Gathers long enough that waiting one out stands clear of a loaded
  // machine's (sanitizer build's) scheduling noise.
  constexpr std::chrono::milliseconds kGather(1000);
  InMemoryLayerSource source(kSpec, kGather);
  PrefetchOptions options;
  options.order = ForwardBackwardOrder(static_cast<uint32_t>(source.view().layouts.size()));
  options.budget_bytes = 100 * LargestLayer(source);
  absl::StatusOr<typename TypeParam::LayerT> kept = absl::UnknownError("unset");
  std::chrono::steady_clock::time_point destroying;
  {
    auto stream = TypeParam::Create(source, options);
    ASSERT_TRUE(stream.ok());
    kept = (*stream)->Next();
    ASSERT_TRUE(kept.ok());
    destroying = std::chrono::steady_clock::now();
  }  // the next gathers are in flight: cancelled, not waited out
  EXPECT_LT(std::chrono::steady_clock::now() - destroying, kGather * 9 / 10);
  // The handed-out layer outlives the stream.
  EXPECT_EQ(kept->index(), 0u);
  uint64_t sum = 0;
  for (uint8_t byte : kept->bytes()) sum += byte;
  EXPECT_GT(sum, 0u);
}

// One layer of kMaxAssembledLayerBytes, as a manifest may claim and
// CheckManifest accepts; gathering it is never attempted.
class HugeLayerSource final : public LayerSource {
 public:
  HugeLayerSource() {
    const uint64_t n = kMaxAssembledLayerBytes / 2;
    view_.model.layers.push_back(
        LayerSpec{"huge", {TensorSpec{"w", {static_cast<int64_t>(n)}, n}}});
    view_.layouts.push_back(*AssembledLayout::FromDTypes({DType::kBFloat16}, {n}));
    view_.gradient_layouts.push_back(view_.layouts.back());
    view_.num_shards = 1;
  }
  const wire::ShardSetView& view() const override { return view_; }
  ClientMetrics* metrics() const override { return nullptr; }
  absl::StatusOr<uint64_t> GatherInto(uint32_t, const GatherOptions&,
                                      std::span<uint8_t>) const override {
    ++gathers_;
    return absl::InternalError("a layer that cannot be allocated was gathered");
  }
  int gathers() const { return gathers_.load(); }

 private:
  wire::ShardSetView view_;
  mutable std::atomic<int> gathers_{0};
};

TEST(LayerStreamTest, ALayerLargerThanTheBudgetIsRefusedBeforeAnythingIsAllocated) {
  HugeLayerSource source;
  LayerStreamOptions options;
  options.order = {0};
  options.budget_bytes = uint64_t{1} << 30;
  auto stream = LayerStream::Create(source, options);
  EXPECT_EQ(stream.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(stream.status().message()),
              HasSubstr("layer 0 (huge) assembles to 256.00 TiB, more than the stream's budget "
                        "of 1.00 GiB"));
  EXPECT_EQ(source.gathers(), 0);
}

TEST(LayerStreamTest, ALayerTheHostCannotHoldIsAnErrorNotAnException) {
  // No budget to speak of: the allocation itself fails (256 TiB is
  // more than a process can map), and Next says so.
  HugeLayerSource source;
  LayerStreamOptions options;
  options.order = {0, 0};
  options.budget_bytes = UINT64_MAX;
  auto stream = LayerStream::Create(source, options);
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (int i = 0; i < 2; ++i) {  // the failed allocation gave its budget back
    absl::StatusOr<Layer> layer = (*stream)->Next();
    EXPECT_EQ(layer.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(layer.status().message()),
                HasSubstr("cannot allocate 281474976710656 bytes (256.00 TiB)"));
  }
  EXPECT_EQ(source.gathers(), 0);
  EXPECT_EQ(LayerBuffer::Allocate(kMaxAssembledLayerBytes + 1).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// What only the device landing has: a dropped layer's memory is free only
// when the device reaches its free. The scheduler must count it as held
// until then, so the device never holds more than the budget, and must wait
// for the free itself when nothing else can make room.
TEST(DeviceLandingTest, PendingFreesHoldTheBudgetUntilTheDeviceReachesThem) {
  InMemoryLayerSource source(kSpec, std::chrono::milliseconds(1));
  const uint32_t n = static_cast<uint32_t>(source.view().layouts.size());
  for (uint64_t budget_layers : {1, 2, 3}) {
    PrefetchOptions options;
    options.order = ForwardBackwardOrder(n);
    options.budget_bytes = budget_layers * LargestLayer(source);
    auto stream = FakeDeviceStream::Create(source, options, std::chrono::milliseconds(20));
    ASSERT_TRUE(stream.ok()) << stream.status();
    for (uint32_t expected : options.order) {
      absl::StatusOr<FakeDeviceLayer> layer = (*stream)->Next();
      ASSERT_TRUE(layer.ok()) << layer.status();
      EXPECT_EQ(layer->index(), expected);
    }  // each layer dropped at once: its free completes 20 ms later
    EXPECT_LE((*stream)->device().peak_bytes(), options.budget_bytes)
        << "the device held more than the budget with " << budget_layers << " layers of budget";
    EXPECT_EQ((*stream)->stats().layers, options.order.size());
  }
}

}  // namespace
}  // namespace layercast::client
