// What a shard's cast-error ledger (server/casting/cast_error_ledger.h) keeps, seen
// through a real in-process shard server on 127.0.0.1 that a worker fetches
// every layer from, twice: a record for each chunk of the grid the server's
// memory plan counts, each lossy one summarised once, in its dtype.

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/model.h"
#include "core/synthetic_model.h"
#include "layercast/v1/config.pb.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "server/casting/cast_error_ledger.h"
#include "server/shard/shard_config.h"
#include "server/shard/shard_server.h"

namespace layercast::server {
namespace {

constexpr char kModel[] = "llama:layers=2,hidden=256,ffn=512,vocab=4096,seed=4";
constexpr uint64_t kChunkBytes = 16 << 10;

// Chunks and their elements, of one dtype.
struct Tally {
  uint64_t chunks = 0;
  uint64_t elements = 0;
  friend bool operator==(const Tally&, const Tally&) = default;
  friend std::ostream& operator<<(std::ostream& out, const Tally& tally) {
    return out << tally.chunks << " chunks of " << tally.elements << " elements";
  }
};

// Shard `shard_index` of `num_shards` of kModel under `policy` (the default
// when empty), loaded and serving; null, failing the test, if it cannot be.
std::unique_ptr<ShardServer> StartShard(const std::string& policy, uint32_t shard_index,
                                        uint32_t num_shards) {
  layercast::v1::ShardConfig config;
  config.set_listen("127.0.0.1:0");
  config.set_num_shards(num_shards);
  config.set_shard_index(shard_index);
  config.set_synthetic(kModel);
  config.set_chunk_bytes(kChunkBytes);
  if (!policy.empty()) config.set_policy(policy);
  auto settings = ResolveShardConfig(config);
  if (!settings.ok()) {
    ADD_FAILURE() << settings.status();
    return nullptr;
  }
  auto server = ShardServer::Create(*std::move(settings));
  if (!server.ok()) {
    ADD_FAILURE() << server.status();
    return nullptr;
  }
  const absl::Status started = (*server)->Start();
  const absl::Status loaded = started.ok() ? (*server)->Load(nullptr) : started;
  if (!loaded.ok()) {
    ADD_FAILURE() << loaded;
    return nullptr;
  }
  return *std::move(server);
}

// Fetches every layer of `model` whole from `server`, calling
// on_chunk(layer, chunk) for each chunk received; a stream that fails fails
// the test.
template <typename OnChunk>
void FetchEveryLayer(const ShardServer& server, const ModelSpec& model, OnChunk&& on_chunk) {
  auto stub = layercast::v1::ShardService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server.port()), grpc::InsecureChannelCredentials()));
  for (uint32_t layer = 0; layer < model.layers.size(); ++layer) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    layercast::v1::FetchLayerRequest request;
    request.set_layer(layer);
    auto reader = stub->FetchLayer(&context, request);
    layercast::v1::LayerChunk chunk;
    while (reader->Read(&chunk)) on_chunk(layer, chunk);
    const grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << "layer " << layer << ": " << status.error_message();
  }
}

// The ledger keeps a record for every chunk of the shard's grid, so each is
// measured once however many workers fetch it, and the memory plan counts a
// record for each: the chunks whole-layer streams send are those the plan
// counts, and the ledger summarises all of them, once.
TEST(ShardServerLedgerTest, KeepsEveryChunkOfTheGridThePlanCounts) {
  auto server = StartShard("", 0, 1);
  ASSERT_NE(server, nullptr);
  const auto sum_ledger = [&] {
    uint64_t chunks = 0;
    for (const CastErrorLedger::LayerSummary& layer : server->cast_errors().Summarize()) {
      chunks += layer.chunks;
    }
    return chunks;
  };
  auto source = SyntheticModel::Create(kModel);
  ASSERT_TRUE(source.ok()) << source.status();
  const ModelSpec& model = (*source)->model();
  uint64_t sent = 0;
  for (int round = 0; round < 2; ++round) {
    sent = 0;
    FetchEveryLayer(*server, model, [&](uint32_t, const layercast::v1::LayerChunk&) { ++sent; });
    EXPECT_EQ(sum_ledger(), sent) << "round " << round << ": each chunk recorded once";
  }
  EXPECT_EQ(server->plan().grid_chunks, sent);
  EXPECT_EQ(server->plan().layers, model.layers.size());
  server->Shutdown(std::chrono::seconds(5));
}

// The same on a shard of several, under policies that mix 8-bit, 16-bit and
// float32 tensors: the plan's grid is every chunk whole-layer streams send,
// float32 chunks (a copy of the master) are kept for their CRC and left out
// of the summaries, and the lossy ones are summarised once, in their dtype,
// at the layer's version.
TEST(ShardServerLedgerTest, SummarisesEveryLossyChunkOfAShardOfSeveral) {
  struct Case {
    std::string policy;
    uint32_t shard_index;
    uint32_t num_shards;
    std::vector<DType> summarised;
  };
  const std::vector<Case> cases = {
      {"p=f32,c=f8e4m3,fp8_block=64;*norm*=f32", 1, 4, {DType::kFloat8E4M3FN}},
      {"p=f32,c=bf16;*norm*=f16;*embed*=f32", 0, 2, {DType::kBFloat16, DType::kFloat16}},
      {"p=f32,c=float8_e5m2,fp8_block=128;*mlp*=bf16;*norm*=f32",
       3,
       4,
       {DType::kBFloat16, DType::kFloat8E5M2}},
  };
  auto source = SyntheticModel::Create(kModel);
  ASSERT_TRUE(source.ok()) << source.status();
  const ModelSpec& model = (*source)->model();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.policy + ", shard " + std::to_string(c.shard_index) + " of " +
                 std::to_string(c.num_shards));
    auto server = StartShard(c.policy, c.shard_index, c.num_shards);
    ASSERT_NE(server, nullptr);
    uint64_t sent = 0;
    std::map<DType, Tally> lossy;
    for (int round = 0; round < 2; ++round) {
      sent = 0;
      lossy.clear();
      FetchEveryLayer(*server, model, [&](uint32_t layer, const layercast::v1::LayerChunk& chunk) {
        ++sent;
        const TensorSpec& tensor = model.layers[layer].tensors[chunk.tensor()];
        const DType dtype = server->settings().policy.ComputeDTypeFor(tensor.name);
        if (dtype != DType::kFloat32) {
          ++lossy[dtype].chunks;
          lossy[dtype].elements += chunk.data().size() / DTypeSize(dtype);
        }
      });
    }
    std::map<DType, Tally> summarised;
    for (const CastErrorLedger::LayerSummary& layer : server->cast_errors().Summarize()) {
      summarised[layer.dtype].chunks += layer.chunks;
      summarised[layer.dtype].elements += layer.error.elements;
      EXPECT_EQ(layer.error.elements,
                layer.error.measured + layer.error.unmeasured + layer.error.overflowed)
          << "layer " << layer.layer << ": synthetic weights are finite and nonzero";
    }
    std::vector<DType> dtypes;
    for (const auto& [dtype, tally] : summarised) dtypes.push_back(dtype);
    EXPECT_EQ(dtypes, c.summarised);
    uint64_t lossy_chunks = 0;
    for (const auto& [dtype, tally] : lossy) lossy_chunks += tally.chunks;
    EXPECT_GT(lossy_chunks, 0u);
    EXPECT_LT(lossy_chunks, sent) << "the policy leaves some tensors in float32";
    EXPECT_EQ(summarised, lossy)
        << "each lossy chunk summarised once over two rounds, in its dtype, with its elements";
    EXPECT_EQ(server->plan().grid_chunks, sent);
    server->Shutdown(std::chrono::seconds(5));
  }
}

}  // namespace
}  // namespace layercast::server
