// fp8 deltas against real shard processes. A publisher publishes to a set
// that serves float8_e4m3fn, and a delta from 1, 2 and K versions back is
// the full pull, code for code and scale for scale: after a few percent of
// the values moved, after every value moved a little (as an optimizer step
// moves them), and after a version that moved only block scales. Then a
// set that trainers read in bfloat16, with a relay that holds the model in
// fp8: a mirror below the relay follows in fp8 deltas, and holds exactly
// what the shards cast.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/model_mirror.h"
#include "client/weight_publisher.h"
#include "core/layout.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "tests/integration/relay_process.h"
#include "tests/integration/shard_fixture.h"

namespace layercast::testing {
namespace {

constexpr char kModel[] = "llama:layers=2,hidden=128,ffn=256,vocab=64";
// Blocks of 32, so a chunk spans many; the norms stay bfloat16.
constexpr char kFp8Policy[] = "p=f32,c=float8_e4m3fn,fp8_block=32;*norm*=bf16";
constexpr char kToken[] = "fp8-delta-token-0123456789abcdef";
constexpr char kFallbacks[] = "layercast_client_delta_fallbacks_total";

using Values = std::map<std::string, std::vector<float>>;

// Whether `a` and `b`, two copies of a layer laid out as `layout`, hold the
// same codes and block scales (and 16-bit values): the padding between
// tensors aside, which a mirror's buffer does not clear.
bool SameTensors(const AssembledLayout& layout, std::span<const uint8_t> a,
                 std::span<const uint8_t> b) {
  for (const AssembledTensor& tensor : layout.tensors()) {
    if (std::memcmp(a.data() + tensor.byte_offset, b.data() + tensor.byte_offset,
                    tensor.num_bytes()) != 0 ||
        (tensor.block_size != 0 &&
         std::memcmp(a.data() + tensor.scale_offset, b.data() + tensor.scale_offset,
                     tensor.scale_bytes()) != 0)) {
      return false;
    }
  }
  return true;
}

class Fp8DeltaTest : public ::testing::Test {
 protected:
  void Start(const std::string& policy) {
    dir_ = MakeTempDir("fp8-delta");
    // --pin-versions 3: an fp8 delta quantizes its base again from the fp32
    // the shard kept of it, so K = 3 versions back needs 3 kept.
    shards_ = StartShards(
        2, {"--synthetic", kModel, "--policy", policy, "--chunk-bytes", "2048", "--pin-versions",
            "3", "--admin-token-file", WriteAdminToken(dir_, kToken)});
    ASSERT_NE(shards_.set, nullptr);
    publisher_ = std::make_unique<client::WeightPublisher>(
        *shards_.set, client::PublishOptions{.admin_token = kToken, .insecure = true});
  }

  // Every tensor of the model, normal values of a trained model's scale
  // with a few outliers that set their blocks' scales.
  Values Random() const {
    std::mt19937 random(5);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    Values values;
    for (const LayerSpec& layer : shards_.set->model().layers) {
      for (const TensorSpec& tensor : layer.tensors) {
        std::vector<float>& v = values[tensor.name];
        v.resize(tensor.num_elements);
        for (size_t i = 0; i < v.size(); ++i)
          v[i] = i % 97 == 0 ? 8 * normal(random) : normal(random);
      }
    }
    return values;
  }

  uint64_t Publish(const Values& values) {
    client::TensorValues view;
    for (const auto& [name, tensor] : values) view.emplace(name, tensor);
    absl::StatusOr<client::PublishResult> published = publisher_->Publish(view);
    EXPECT_TRUE(published.ok()) << published.status();
    return published.ok() ? published->version : 0;
  }

  // Layer `layer` pulled from `set` (in full without `base`) onto `start`;
  // the chunk bytes received into `*received` when given.
  std::vector<uint8_t> Pull(const client::ShardSet& set, uint32_t layer, std::vector<uint8_t> start,
                            std::optional<uint64_t> base, bool gaps = true,
                            uint64_t* received = nullptr) const {
    client::GatherOptions options;
    options.base_version = base;
    options.changed_gaps = gaps;
    std::atomic<uint64_t> bytes{0};
    options.on_chunk = [&bytes](uint64_t n) { bytes += n; };
    const absl::StatusOr<uint64_t> version = set.GatherInto(layer, options, start);
    EXPECT_TRUE(version.ok()) << version.status();
    if (received != nullptr) *received += bytes;
    return start;
  }

  std::string dir_;
  RunningShards shards_;
  std::unique_ptr<client::WeightPublisher> publisher_;
};

TEST_F(Fp8DeltaTest, DeltasAfterOneTwoAndKVersionsAreTheFullPullCodeForCode) {
  ASSERT_NO_FATAL_FAILURE(Start(kFp8Policy));
  const client::ShardSet& set = *shards_.set;
  const auto layers = static_cast<uint32_t>(set.model().layers.size());
  Values values = Random();
  std::mt19937 random(9);
  std::bernoulli_distribution few(0.03);
  // Each version's change, from the one before.
  const std::vector<std::pair<std::string, std::function<void(float&)>>> changes = {
      {"a few percent moved", [&](float& x) { x = few(random) ? x * 1.05f + 1e-4f : x; }},
      {"every value moved a little (an optimizer step)",
       [&](float& x) { x += random() % 2 == 0 ? 2e-5f : -2e-5f; }},
      // Doubled, x / s is the same quotient: every code stays, every scale
      // moves (the bfloat16 norms are left as they are, below).
      {"only the block scales moved", [](float& x) { x *= 2; }},
      {"a few percent moved again", [&](float& x) { x = few(random) ? -x : x; }},
  };
  ASSERT_EQ(Publish(values), 1u);
  std::vector<std::vector<std::vector<uint8_t>>> held(2);  // [version][layer]
  for (uint32_t l = 0; l < layers; ++l) {
    held[1].push_back(Pull(set, l, std::vector<uint8_t>(set.view().layouts[l].total_bytes()), {}));
  }
  // Mirrors apply the same deltas in place, and through staging copies.
  std::vector<std::unique_ptr<client::ModelMirror>> mirrors;
  for (const uint64_t staging : {uint64_t{0}, uint64_t{1} << 30}) {
    client::MirrorOptions options;
    options.staging_bytes = staging;
    absl::StatusOr<std::unique_ptr<client::ModelMirror>> mirror =
        client::ModelMirror::Create(set, options);
    ASSERT_TRUE(mirror.ok()) << mirror.status();
    mirrors.push_back(*std::move(mirror));
  }
  uint64_t step_delta = 0, step_full = 0;
  for (size_t c = 0; c < changes.size(); ++c) {
    for (auto& [name, tensor] : values) {
      if (c == 2 && name.find("norm") != std::string::npos) continue;
      for (float& x : tensor) changes[c].second(x);
    }
    const uint64_t version = Publish(values);
    ASSERT_EQ(version, c + 2);
    held.emplace_back();
    for (uint32_t l = 0; l < layers; ++l) {
      uint64_t* full_bytes = c == 1 ? &step_full : nullptr;
      held[version].push_back(
          Pull(set, l, std::vector<uint8_t>(held[1][l].size()), {}, true, full_bytes));
      EXPECT_NE(held[version][l], held[version - 1][l]) << changes[c].first;
      for (uint64_t base = std::max<uint64_t>(1, version - 3); base < version; ++base) {
        for (const bool gaps : {true, false}) {
          uint64_t* delta_bytes = c == 1 && base + 1 == version && gaps ? &step_delta : nullptr;
          EXPECT_TRUE(Pull(set, l, held[base][l], base, gaps, delta_bytes) == held[version][l])
              << "layer " << l << " from version " << base << " to " << version << " after "
              << changes[c].first << (gaps ? ", gaps allowed" : ", bitmaps only");
        }
      }
    }
    for (const auto& mirror : mirrors) {
      const absl::StatusOr<client::MirrorUpdate> update = mirror->Update(version);
      ASSERT_TRUE(update.ok()) << update.status();
      EXPECT_EQ(update->changed_layers.size(), layers) << changes[c].first << ": every layer moved";
      auto reading = mirror->Read();
      for (uint32_t l = 0; l < layers; ++l) {
        EXPECT_TRUE(SameTensors(set.view().layouts[l], reading.layer(l).bytes(), held[version][l]))
            << "a mirror's layer " << l << " at version " << version << " after "
            << changes[c].first;
      }
    }
  }
  EXPECT_EQ(CounterValue(*shards_.registry, kFallbacks).value_or(0), 0)
      << "every delta served as a delta";
  // An optimizer step moves every scale and a few codes: far less than a
  // full pull.
  EXPECT_LT(step_delta, step_full / 3) << step_delta << " bytes against " << step_full;

  // The version that moved only scales: its delta carries no code.
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t s = 0; s < 2; ++s) {
      grpc::ClientContext context;
      layercast::v1::FetchLayerRequest request;
      request.set_layer(l);
      request.set_base_version(3);
      request.set_exact_version(4);
      auto reader = set.stub(s).FetchLayer(&context, request);
      uint64_t fp8_chunks = 0;
      for (layercast::v1::LayerChunk chunk; reader->Read(&chunk);) {
        if (set.view().layouts[l].tensors()[chunk.tensor()].block_size == 0) continue;
        ++fp8_chunks;
        EXPECT_TRUE(chunk.data().empty()) << "layer " << l << " tensor " << chunk.tensor();
        EXPECT_FALSE(chunk.scales().empty()) << "layer " << l << " tensor " << chunk.tensor();
      }
      EXPECT_TRUE(reader->Finish().ok());
      EXPECT_GT(fp8_chunks, 0u);
    }
  }

  // A base the shard no longer keeps (past --pin-versions) is refused, and
  // the library pulls in full.
  EXPECT_TRUE(Pull(set, 0, held[1][0], 1) == held.back()[0]);
  EXPECT_EQ(CounterValue(*shards_.registry, kFallbacks).value_or(0), 1);
}

TEST_F(Fp8DeltaTest, AnFp8RelayOfABfloat16SetFeedsMirrorsFp8Deltas) {
  ASSERT_NO_FATAL_FAILURE(Start("p=f32,c=bf16,fp8_block=32;*norm*=f32"));
  RelayProcess relay(dir_, "relay", shards_.set->addresses(), "",
                     {"--dtype", "float8_e4m3fn", "--keep-versions", "2"});
  ASSERT_EQ(relay.addresses().size(), 2u) << relay.log();
  const auto registry = std::make_shared<prometheus::Registry>();
  client::ShardSetOptions options;
  options.registry = registry;
  absl::StatusOr<std::unique_ptr<client::ShardSet>> below =
      client::ShardSet::Connect(relay.addresses(), options);
  ASSERT_TRUE(below.ok()) << below.status();

  // Its manifest says what it holds, every tensor in fp8 (the shards' policy
  // and digest kept), to the library and to `layercast manifest`.
  const layercast::v1::Manifest& listed = (*below)->manifests()[0];
  EXPECT_EQ(listed.held_dtype(), layercast::v1::FLOAT8_E4M3FN);
  EXPECT_EQ(listed.policy(), shards_.set->manifests()[0].policy());
  EXPECT_EQ(listed.layout_digest(), shards_.set->manifests()[0].layout_digest());
  for (const layercast::v1::Layer& layer : listed.layers()) {
    for (const layercast::v1::Tensor& tensor : layer.tensors()) {
      EXPECT_EQ(tensor.compute_dtype(), layercast::v1::FLOAT8_E4M3FN) << tensor.name();
    }
  }
  std::string output;
  ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " manifest --shards ", relay.addresses()[0], ",",
                                    relay.addresses()[1]),
                       &output),
            0)
      << output;
  EXPECT_THAT(output, ::testing::HasSubstr("FLOAT8_E4M3FN"));
  EXPECT_THAT(output, ::testing::Not(::testing::HasSubstr("BFLOAT16"))) << output;

  // A mirror that reads the policy's dtypes is told which tensor, by name.
  client::MirrorOptions mirror_options;
  mirror_options.layer_timeout = std::chrono::seconds(10);
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> policy_mirror =
      client::ModelMirror::Create(**below, mirror_options);
  ASSERT_FALSE(policy_mirror.ok());
  EXPECT_EQ(policy_mirror.status().code(), absl::StatusCode::kFailedPrecondition);
  int named = 0;
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    const LayerSpec& layer = shards_.set->model().layers[l];
    named += absl::StrContains(policy_mirror.status().message(),
                               absl::StrCat("holds layer ", l, " (", layer.name, ")'s tensor 0 (",
                                            layer.tensors[0].name, ") in float8_e4m3fn, not "));
  }
  EXPECT_EQ(named, 1) << policy_mirror.status();

  mirror_options.dtype = DType::kFloat8E4M3FN;
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> mirror =
      client::ModelMirror::Create(**below, mirror_options);
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  Values values = Random();
  std::mt19937 random(3);
  // Versions 2 and 3 move a few percent of the values; version 4 doubles
  // them all, which in fp8 moves every block scale and no code.
  double dense_refused = 0;
  for (uint64_t version = 1; version <= 4; ++version) {
    std::bernoulli_distribution few(version == 1 ? 1.0 : 0.03);
    for (auto& [name, tensor] : values) {
      for (float& x : tensor) x = version == 4 ? 2 * x : few(random) ? x * 1.05f + 1e-4f : x;
    }
    ASSERT_EQ(Publish(values), version);
    absl::StatusOr<client::MirrorUpdate> update = (*mirror)->Update(version);
    ASSERT_TRUE(update.ok()) << update.status();
    auto reading = (*mirror)->Read();
    ASSERT_EQ(reading.version(), version);
    uint64_t full = 0;
    for (uint32_t l = 0; l < reading.num_layers(); ++l) {
      // What the shards cast in fp8 themselves.
      client::GatherOptions options;
      options.dtype = DType::kFloat8E4M3FN;
      options.exact_version = version;
      std::vector<uint8_t> cast(reading.layer(l).bytes().size());
      ASSERT_TRUE(shards_.set->GatherInto(l, options, cast).ok());
      full += cast.size();
      const AssembledLayout layout =
          *LayoutIn(shards_.set->view().layouts[l], DType::kFloat8E4M3FN, /*fp8_block=*/32);
      EXPECT_TRUE(SameTensors(layout, cast, reading.layer(l).bytes()))
          << "layer " << l << " at version " << version;
    }
    if (version > 1) {
      EXPECT_LT(update->bytes, full / 2) << "version " << version << ": deltas, not full pulls";
    }
    EXPECT_EQ(update->changed_layers.size(), reading.num_layers()) << "version " << version;
    if (version == 1) {
      // Every code moved: each delta would outweigh the layer, so the relay
      // refused it and the mirror pulled in full.
      dense_refused = CounterValue(*registry, kFallbacks).value_or(0);
      EXPECT_GT(dense_refused, 0);
    }
  }
  EXPECT_EQ(CounterValue(*registry, kFallbacks).value_or(0), dense_refused)
      << "versions 2 to 4 came as deltas";
}

}  // namespace
}  // namespace layercast::testing
