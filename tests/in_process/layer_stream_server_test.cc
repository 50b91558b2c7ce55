// LayerStream over a real ShardSet: two in-process shard servers on
// 127.0.0.1, a forward-backward walk under a budget, bit-exact layers, and
// the worker library's metrics.

#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <cstring>

#include "client/layer_stream.h"
#include "client/shard_set.h"
#include "core/cast.h"
#include "core/synthetic_model.h"
#include "server/shard/shard_server.h"

namespace layercast::client {
namespace {

constexpr char kModel[] = "llama:layers=3,hidden=128,ffn=352,vocab=1000,seed=8";

std::vector<std::unique_ptr<server::ShardServer>> StartShards(uint32_t n) {
  std::vector<std::unique_ptr<server::ShardServer>> servers;
  for (uint32_t i = 0; i < n; ++i) {
    layercast::v1::ShardConfig config;
    config.set_listen("127.0.0.1:0");
    config.set_shard_index(i);
    config.set_num_shards(n);
    config.set_synthetic(kModel);
    config.set_policy("c=bf16;*norm*=f32");
    auto server = server::ShardServer::Create(*server::ResolveShardConfig(config));
    EXPECT_TRUE(server.ok()) << server.status();
    EXPECT_TRUE((*server)->Start().ok());
    EXPECT_TRUE((*server)->Load(nullptr).ok());
    servers.push_back(*std::move(server));
  }
  return servers;
}

double Sum(const prometheus::Registry& registry, const std::string& name) {
  double total = 0;
  for (const auto& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const auto& metric : family.metric) {
      total += metric.counter.value + static_cast<double>(metric.histogram.sample_count);
    }
  }
  return total;
}

TEST(LayerStreamServerTest, ForwardBackwardWalkIsExactAndWithinBudget) {
  auto servers = StartShards(2);
  auto registry = std::make_shared<prometheus::Registry>();
  ShardSetOptions set_options;
  set_options.registry = registry;
  auto set = ShardSet::Connect({"127.0.0.1:" + std::to_string(servers[0]->port()),
                                "127.0.0.1:" + std::to_string(servers[1]->port())},
                               set_options);
  ASSERT_TRUE(set.ok()) << set.status();
  auto source = SyntheticModel::Create(kModel);

  uint64_t largest = 0;
  for (const auto& layout : (*set)->view().layouts)
    largest = std::max(largest, layout.total_bytes());
  LayerStreamOptions options;
  const uint32_t n = static_cast<uint32_t>((*set)->model().layers.size());
  options.order = ForwardBackwardOrder(n);
  options.budget_bytes = 2 * largest;
  auto stream = LayerStream::Create(**set, options);
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (uint32_t expected : options.order) {
    absl::StatusOr<Layer> layer = (*stream)->Next();
    ASSERT_TRUE(layer.ok()) << layer.status();
    ASSERT_EQ(layer->index(), expected);
    for (size_t t = 0; t < layer->num_tensors(); ++t) {
      const Layer::TensorView view = layer->tensor(t);
      std::vector<float> master(view.num_elements);
      ASSERT_TRUE((*source)->Read(expected, t, ElementRange{0, view.num_elements}, master).ok());
      std::vector<uint8_t> cast(view.bytes.size());
      ASSERT_TRUE(
          CastFromF32(master.data(), cast.data(), master.size(), view.dtype, Fp16Overflow::kError)
              .ok());
      ASSERT_EQ(std::memcmp(cast.data(), view.bytes.data(), cast.size()), 0) << view.name;
    }
  }
  const LayerStreamStats stats = (*stream)->stats();
  EXPECT_LE(stats.peak_bytes, options.budget_bytes);
  EXPECT_EQ(stats.hits + stats.misses, options.order.size());

  EXPECT_EQ(Sum(*registry, "layercast_client_prefetch_total"), options.order.size());
  EXPECT_EQ(Sum(*registry, "layercast_client_gathers_total"), options.order.size());
  EXPECT_EQ(Sum(*registry, "layercast_client_gather_duration_seconds"), options.order.size());
  uint64_t expected_bytes = 0;
  for (uint32_t layer : options.order)
    expected_bytes += (*set)->view().layouts[layer].total_bytes();
  EXPECT_EQ(Sum(*registry, "layercast_client_received_bytes_total"), expected_bytes);
  for (auto& server : servers) server->Shutdown(std::chrono::seconds(5));
}

}  // namespace
}  // namespace layercast::client
