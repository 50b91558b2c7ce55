// The cast cache (--cast-cache-bytes) on real read-only shards: reads sent
// from it are the bytes a shard without it casts, and the scalar cast's; a
// publish's new values are served, never the cached old ones; a layer the
// cache has no room for is still served, cast as before.

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/weight_publisher.h"
#include "core/cast.h"
#include "core/layout.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

constexpr char kToken[] = "cast-cache-token-0123456789abcdef";
constexpr char kPolicy[] = "p=f32,c=bf16;*norm*=f32";
constexpr char kCachedChunks[] = R"(layercast_chunks_total{source="cache"})";

class CastCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("cast_cache");
    model_ = WriteTestModel(dir_ + "/model.safetensors", 2, 23);
  }

  // Two read-only shards of the model; with `cache_bytes`, the cache on.
  RunningShards Start(const std::string& logs, uint64_t cache_bytes = 0) {
    std::vector<std::string> flags = {
        "--model",       model_.path, "--policy",         kPolicy,
        "--chunk-bytes", "4096",      "--metrics-listen", "127.0.0.1:0"};
    if (cache_bytes > 0) {
      flags.insert(flags.end(), {"--cast-cache-bytes", absl::StrCat(cache_bytes),
                                 "--admin-token-file", WriteAdminToken(dir_, kToken)});
    }
    return StartShards(2, flags, logs);
  }

  static std::vector<uint8_t> Bytes(const RunningShards& shards, uint32_t layer) {
    std::vector<uint8_t> bytes(shards.set->view().layouts[layer].total_bytes());
    const absl::StatusOr<uint64_t> version = shards.set->GatherInto(layer, {}, bytes);
    EXPECT_TRUE(version.ok()) << version.status();
    return bytes;
  }

  // `bytes` (layer `layer` gathered whole) hold `values` as the scalar cast
  // gives each tensor's compute dtype.
  static void ExpectScalarCast(const RunningShards& shards, uint32_t layer,
                               const std::vector<uint8_t>& bytes,
                               const std::map<std::string, std::vector<float>>& values) {
    const AssembledLayout& layout = shards.set->view().layouts[layer];
    for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
      const AssembledTensor& tensor = layout.tensors()[t];
      const std::string& name = shards.set->model().layers[layer].tensors[t].name;
      const std::vector<float>& expected = values.at(name);
      std::vector<uint8_t> cast(expected.size() * DTypeSize(tensor.compute_dtype));
      if (tensor.compute_dtype == DType::kBFloat16) {
        CastF32ToBF16(expected, {reinterpret_cast<uint16_t*>(cast.data()), expected.size()},
                      CastIsa::kScalar);
      } else {
        ASSERT_EQ(tensor.compute_dtype, DType::kFloat32) << name;
        std::memcpy(cast.data(), expected.data(), cast.size());
      }
      ASSERT_EQ(std::memcmp(bytes.data() + tensor.byte_offset, cast.data(), cast.size()), 0)
          << name;
    }
  }

  // Chunks both shards sent from their cast caches.
  double CachedChunks(const std::string& logs) const {
    double sum = 0;
    for (int shard = 0; shard < 2; ++shard) {
      sum += ShardMetric(absl::StrCat(logs, "/shard-", shard, ".log"), kCachedChunks).value_or(-1);
    }
    return sum;
  }

  std::string dir_;
  TestModel model_;
};

TEST_F(CastCacheTest, CachedReadsAreTheCastBitForBitAndAPublishIsServedNew) {
  const std::string logs = MakeTempDir("cast_cache_logs");
  RunningShards cached = Start(logs, 1ull << 30);
  ASSERT_NE(cached.set, nullptr);
  RunningShards plain = Start(MakeTempDir("plain_logs"));
  ASSERT_NE(plain.set, nullptr);
  const uint32_t layers = static_cast<uint32_t>(cached.set->model().layers.size());
  EXPECT_EQ(CachedChunks(logs), 0);
  for (uint32_t l = 0; l < layers; ++l) {
    const std::vector<uint8_t> first = Bytes(cached, l);  // cast into the cache
    const double before = CachedChunks(logs);
    const std::vector<uint8_t> second = Bytes(cached, l);  // sent from it
    EXPECT_GT(CachedChunks(logs), before) << "layer " << l << " was not sent from the cache";
    EXPECT_EQ(first, second) << "layer " << l;
    EXPECT_EQ(second, Bytes(plain, l)) << "layer " << l << " differs from a shard without cache";
    ASSERT_NO_FATAL_FAILURE(ExpectScalarCast(cached, l, second, model_.values));
  }

  // Every third value nudged: each layer's new version replaces the cached
  // one as it is read.
  std::map<std::string, std::vector<float>> nudged = model_.values;
  for (auto& [name, values] : nudged) {
    for (size_t i = 0; i < values.size(); i += 3) values[i] *= 1.0f + 1.0f / 16;
  }
  client::TensorValues view;
  for (const auto& [name, tensor] : nudged) view.emplace(name, tensor);
  client::WeightPublisher publisher(*cached.set, {.admin_token = kToken, .insecure = true});
  const absl::StatusOr<client::PublishResult> published = publisher.Publish(view);
  ASSERT_TRUE(published.ok()) << published.status();
  for (uint32_t l = 0; l < layers; ++l) {
    const std::vector<uint8_t> first = Bytes(cached, l);
    ASSERT_NO_FATAL_FAILURE(ExpectScalarCast(cached, l, first, nudged));
    const double before = CachedChunks(logs);
    const std::vector<uint8_t> second = Bytes(cached, l);
    EXPECT_GT(CachedChunks(logs), before) << "layer " << l << "'s new version was not cached";
    ASSERT_NO_FATAL_FAILURE(ExpectScalarCast(cached, l, second, nudged));
  }
}

TEST_F(CastCacheTest, ALayerWithoutRoomIsCastAsBefore) {
  // Room for the smallest layer on either shard, and no other.
  RunningShards probe = Start(MakeTempDir("probe_logs"));
  ASSERT_NE(probe.set, nullptr);
  // A copy: the probe set goes before the cached one starts.
  const std::vector<AssembledLayout> layouts = probe.set->view().layouts;
  std::vector<std::array<uint64_t, 2>> share(layouts.size());
  for (size_t l = 0; l < layouts.size(); ++l) {
    for (uint32_t shard = 0; shard < 2; ++shard) {
      for (const AssembledTensor& tensor : layouts[l].tensors()) {
        share[l][shard] += ShardElementRange(tensor.num_elements, shard, 2).size() *
                           DTypeSize(tensor.compute_dtype);
      }
    }
  }
  size_t smallest = 0;
  for (size_t l = 1; l < layouts.size(); ++l) {
    if (share[l][0] < share[smallest][0]) smallest = l;
  }
  const uint64_t room = std::max(share[smallest][0], share[smallest][1]);
  for (size_t l = 0; l < layouts.size(); ++l) {
    if (l != smallest) {
      ASSERT_GT(std::min(share[l][0], share[l][1]), room) << "layer " << l;
    }
  }
  probe = {};

  const std::string logs = MakeTempDir("small_cache_logs");
  RunningShards cached = Start(logs, room);
  ASSERT_NE(cached.set, nullptr);
  for (uint32_t l = 0; l < layouts.size(); ++l) {
    for (int read = 0; read < 2; ++read) {
      const double before = CachedChunks(logs);
      const std::vector<uint8_t> bytes = Bytes(cached, l);
      ASSERT_NO_FATAL_FAILURE(ExpectScalarCast(cached, l, bytes, model_.values));
      if (read == 1 && l == smallest) {
        EXPECT_GT(CachedChunks(logs), before) << "the layer that fits is sent from the cache";
      } else {
        EXPECT_EQ(CachedChunks(logs), before) << "layer " << l << ", read " << read;
      }
    }
  }
  for (int shard = 0; shard < 2; ++shard) {
    const std::string log = absl::StrCat(logs, "/shard-", shard, ".log");
    EXPECT_EQ(ShardMetric(log, "layercast_cast_cache_layers"), 1);
    EXPECT_EQ(ShardMetric(log, "layercast_cast_cache_bytes"), share[smallest][shard]);
  }
}

}  // namespace
}  // namespace layercast::testing
