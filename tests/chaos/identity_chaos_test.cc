// A version is an identity, not a number (docs/recovery.md): a shard that
// comes back without its history counts from 0 again, and a publish may give
// an old number other values. Readers from before such a restart — a gather
// resumed across it, a pinned walk, a mirror and a relay — end holding one
// incarnation's bits of the number they name, or fail naming both; never a
// mixture. The shard dies at the failpoint fetch.mid_stream, which each test
// asserts fired and killed it by SIGKILL.

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "client/model_mirror.h"
#include "client/weight_publisher.h"
#include "core/cast.h"
#include "core/crc32c.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "tests/integration/relay_process.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"
#include "wire/incarnation.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;
using Values = std::map<std::string, std::vector<float>>;

constexpr char kToken[] = "identity-token-0123456789abcdef";
constexpr int kLayers = 2;
constexpr uint64_t kSeed = 29;
// Layer 0 (the embeddings) is 4 chunks of 4096 bytes: the 6th chunk the
// shard sends is mid-way through layer 1.
constexpr char kMidLayer1[] = "fetch.mid_stream:6";

class IdentityChaosTest : public ::testing::Test {
 protected:
  // `num_shards` read-only shards without checkpoints; `failpoint` armed
  // in them, to fire once over the set's life.
  void StartSet(uint32_t num_shards, const std::string& failpoint) {
    dir_ = MakeTempDir("identity");
    model_ = WriteTestModel(dir_ + "/model.safetensors", kLayers, kSeed);
    tools::LocalShardSet::Options options;
    options.shard_binary = ShardBinary();
    options.num_shards = num_shards;
    options.extra_flags = {
        "--model",           model_.path, "--chunk-bytes",      "4096",
        "--publish-idle-ms", "1000",      "--admin-token-file", WriteAdminToken(dir_, kToken)};
    options.log_dir = dir_;
    if (!failpoint.empty()) {
      options.environment = {"LAYERCAST_FAILPOINT=" + failpoint,
                             "LAYERCAST_FAILPOINT_ONCE=" + fired()};
    }
    auto processes = tools::LocalShardSet::Start(options);
    ASSERT_TRUE(processes.ok()) << processes.status();
    processes_ = *std::move(processes);
    client::ShardSetOptions connect;
    connect.connect_timeout = std::chrono::seconds(30);
    auto set = client::ShardSet::Connect(processes_->addresses(), connect);
    ASSERT_TRUE(set.ok()) << set.status();
    set_ = *std::move(set);
    publisher_.emplace(*set_, client::PublishOptions{.admin_token = kToken, .insecure = true});
  }

  void TearDown() override {
    if (processes_ != nullptr) {
      EXPECT_EQ(processes_->Stop(), absl::OkStatus());
    }
  }

  std::string fired() const { return dir_ + "/fired"; }

  // The model's values, every third one scaled by 1 + step.
  Values Nudged(float step) const {
    Values nudged = model_.values;
    for (auto& [name, values] : nudged) {
      for (size_t i = 0; i < values.size(); i += 3) values[i] *= 1 + step;
    }
    return nudged;
  }

  void Publish(const Values& values) {
    client::TensorValues view;
    for (const auto& [name, tensor] : values) view.emplace(name, tensor);
    const absl::StatusOr<client::PublishResult> published = publisher_->Publish(view);
    ASSERT_TRUE(published.ok()) << published.status();
  }

  // Waits for shard `shard` to die at the failpoint and starts it again, as
  // its pod would come back: without a checkpoint, at version 0.
  void AwaitDeathAndRestart(uint32_t shard) {
    int wait_status = 0;
    const absl::StatusOr<int> exited =
        processes_->WaitForExitForTest(shard, std::chrono::seconds(30), &wait_status);
    ASSERT_TRUE(exited.ok()) << "the shard did not die at the failpoint: " << exited.status();
    ASSERT_TRUE(KilledBySigkill(wait_status))
        << "shard " << shard << " ended by " << DescribeWaitStatus(wait_status)
        << ", not by its failpoint's SIGKILL";
    ASSERT_TRUE(std::filesystem::exists(fired())) << "the failpoint never fired";
    ASSERT_TRUE(processes_->RestartForTest(shard).ok());
    AwaitAnswers();
  }

  // Until every shard answers on the set's channels again (they back off
  // after a refused connection), at most 30 s.
  void AwaitAnswers() const {
    for (int turn = 0; turn < 300; ++turn) {
      if (set_->CurrentIdentity(std::chrono::seconds(1)).ok()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ADD_FAILURE() << "the set did not answer within 30 s of the restart";
  }

  // Gathers layer 1 with `options` on a thread of its own while the shard
  // (1 of 1) dies at the failpoint mid-way through it, comes back at version
  // 0 and is published twice, to a second version 2 holding `second`.
  std::optional<absl::StatusOr<client::Layer>> GatherAcrossARepublish(
      const client::GatherOptions& options, const Values& second) {
    std::optional<absl::StatusOr<client::Layer>> gathered;
    std::thread gathering([&] { gathered = set_->Gather(1, options); });
    AwaitDeathAndRestart(0);
    if (!HasFatalFailure()) {
      Publish(Nudged(1.0f / 16));
      Publish(second);
    }
    gathering.join();
    return gathered;
  }

  // `bytes` (layer `layer`'s assembled layout) hold `values` cast to each
  // tensor's compute dtype.
  void ExpectHolds(uint32_t layer, std::span<const uint8_t> bytes, const Values& values,
                   const std::string& what) const {
    const AssembledLayout& layout = set_->view().layouts[layer];
    for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
      const AssembledTensor& tensor = layout.tensors()[t];
      const std::string& name = set_->model().layers[layer].tensors[t].name;
      const std::vector<float>& expected = values.at(name);
      std::vector<uint8_t> cast(expected.size() * DTypeSize(tensor.compute_dtype));
      ASSERT_TRUE(CastFromF32(expected.data(), cast.data(), expected.size(), tensor.compute_dtype,
                              Fp16Overflow::kInfinity)
                      .ok());
      ASSERT_EQ(std::memcmp(bytes.data() + tensor.byte_offset, cast.data(), cast.size()), 0)
          << what << ": " << name << " of layer " << layer << " is not one version's values";
    }
  }

  std::string dir_;
  TestModel model_;
  std::unique_ptr<tools::LocalShardSet> processes_;
  std::unique_ptr<client::ShardSet> set_;
  std::optional<client::WeightPublisher> publisher_;
};

// The shard dies mid-way through the layer; it comes back at version 0 and
// two publishes bring it to version 2 with other values. The gather, pinned
// to version 2 and retrying meanwhile, must not keep the chunks of the first
// version 2 beside those of the second.
TEST_F(IdentityChaosTest, AGatherResumedAcrossARestartAndARepublishHoldsOneVersionsBits) {
  ASSERT_NO_FATAL_FAILURE(StartSet(1, kMidLayer1));
  const Values first = Nudged(1.0f / 4), second = Nudged(-1.0f / 2);
  ASSERT_NO_FATAL_FAILURE(Publish(Nudged(1.0f / 8)));
  ASSERT_NO_FATAL_FAILURE(Publish(first));
  ASSERT_TRUE(set_->Gather(0).ok());  // layer 0: the first 4 chunks

  client::GatherOptions pinned;
  pinned.exact_version = 2;
  pinned.timeout = std::chrono::seconds(60);
  const std::optional<absl::StatusOr<client::Layer>> gathered =
      GatherAcrossARepublish(pinned, second);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(gathered.has_value());
  ASSERT_TRUE(gathered->ok()) << gathered->status();
  EXPECT_EQ((*gathered)->version(), 2u);
  ExpectHolds(1, (*gathered)->bytes(), second, "the resumed gather");
}

// A walk pinned to version 2 reads layer 0 and 1 of the first version 2;
// the shard dies mid-way through layer 1, comes back and is published to a
// second version 2. The walk refuses to go on with layer 1 (naming both
// incarnations) rather than mix the two; walked again, it reads the second.
TEST_F(IdentityChaosTest, APinnedWalkAcrossARestartRefusesToMixTwoVersionsOfOneNumber) {
  ASSERT_NO_FATAL_FAILURE(StartSet(1, kMidLayer1));
  const Values first = Nudged(1.0f / 4), second = Nudged(-1.0f / 2);
  ASSERT_NO_FATAL_FAILURE(Publish(Nudged(1.0f / 8)));
  ASSERT_NO_FATAL_FAILURE(Publish(first));

  client::PinnedIdentity walk;
  client::GatherOptions pinned;
  pinned.exact_version = 2;
  pinned.timeout = std::chrono::seconds(60);
  pinned.pinned_identity = &walk;
  absl::StatusOr<client::Layer> layer0 = set_->Gather(0, pinned);
  ASSERT_TRUE(layer0.ok()) << layer0.status();
  ASSERT_NO_FATAL_FAILURE(ExpectHolds(0, layer0->bytes(), first, "the walk's first layer"));
  ASSERT_EQ(walk.incarnations().size(), 1u) << "the walk recorded no identity";
  const uint64_t before = walk.incarnations()[0];

  const std::optional<absl::StatusOr<client::Layer>> layer1 =
      GatherAcrossARepublish(pinned, second);
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(layer1.has_value());
  ASSERT_EQ(layer1->status().code(), absl::StatusCode::kAborted) << layer1->status();
  EXPECT_THAT(layer1->status().message(),
              HasSubstr("incarnation " + wire::IncarnationName(before)));
  EXPECT_THAT(layer1->status().message(), HasSubstr("walk again from the first layer"));

  client::PinnedIdentity again;
  pinned.pinned_identity = &again;
  for (uint32_t l = 0; l < set_->model().layers.size(); ++l) {
    absl::StatusOr<client::Layer> layer = set_->Gather(l, pinned);
    ASSERT_TRUE(layer.ok()) << layer.status();
    ASSERT_NO_FATAL_FAILURE(ExpectHolds(l, layer->bytes(), second, "the walk again"));
  }
  ASSERT_EQ(again.incarnations().size(), 1u);
  EXPECT_NE(again.incarnations()[0], before);
}

// The whole set dies and comes back without checkpoints; three publishes
// bring it to version 3, below the 5 a mirror and a relay held. Both follow
// it down: the mirror of the shards and the mirror below the relay end with
// exactly the shards' bits of version 3. (Killed by the test: a failpoint
// would fire in the mirrors' own first pulls.)
TEST_F(IdentityChaosTest, AMirrorAndARelayFollowASetThatStartedCountingAgain) {
  ASSERT_NO_FATAL_FAILURE(StartSet(2, ""));
  for (int v = 1; v <= 5; ++v) ASSERT_NO_FATAL_FAILURE(Publish(Nudged(v / 32.0f)));
  RelayProcess relay(dir_, "relay", processes_->addresses(), "");
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::seconds(30);
  auto relayed = client::ShardSet::Connect(relay.addresses(), connect);
  ASSERT_TRUE(relayed.ok()) << relayed.status();
  client::MirrorOptions follow;
  follow.poll = std::chrono::seconds(2);
  follow.max_backoff = std::chrono::milliseconds(500);
  auto mirror = client::ModelMirror::Create(*set_, follow);
  ASSERT_TRUE(mirror.ok()) << mirror.status();
  auto below = client::ModelMirror::Create(**relayed, follow);
  ASSERT_TRUE(below.ok()) << below.status();
  (*mirror)->Follow();
  (*below)->Follow();
  ASSERT_TRUE((*below)->WaitForVersion(5, std::chrono::seconds(30)));
  ASSERT_EQ((*mirror)->version(), 5u);

  // Both shards die at once (SIGKILL, as a node's loss would) and come
  // back empty-handed.
  for (uint32_t shard = 0; shard < 2; ++shard) processes_->KillForTest(shard);
  for (uint32_t shard = 0; shard < 2; ++shard) ASSERT_TRUE(processes_->RestartForTest(shard).ok());
  AwaitAnswers();
  const Values third = Nudged(-3.0f / 4);
  ASSERT_NO_FATAL_FAILURE(Publish(Nudged(1.0f / 3)));
  ASSERT_NO_FATAL_FAILURE(Publish(Nudged(2.0f / 3)));
  ASSERT_NO_FATAL_FAILURE(Publish(third));

  for (client::ModelMirror* held : {mirror->get(), below->get()}) {
    const std::string what = held == mirror->get() ? "the shards' mirror" : "the relay's child";
    bool there = false;
    for (int turn = 0; turn < 300 && !there; ++turn) {  // 30 s
      {
        auto reading = held->Read();
        there = reading.version() == 3;
        for (uint32_t l = 0; there && l < reading.num_layers(); ++l) {
          const std::span<const uint8_t> bytes = reading.layer(l).bytes();
          const AssembledLayout& layout = set_->view().layouts[l];
          for (uint32_t t = 0; there && t < layout.tensors().size(); ++t) {
            const AssembledTensor& tensor = layout.tensors()[t];
            const std::vector<float>& expected = third.at(set_->model().layers[l].tensors[t].name);
            std::vector<uint8_t> cast(expected.size() * DTypeSize(tensor.compute_dtype));
            there = CastFromF32(expected.data(), cast.data(), expected.size(), tensor.compute_dtype,
                                Fp16Overflow::kInfinity)
                        .ok() &&
                    std::memcmp(bytes.data() + tensor.byte_offset, cast.data(), cast.size()) == 0;
          }
        }
      }
      if (!there) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    EXPECT_TRUE(there) << what << " holds version " << held->version()
                       << ", not the shards' bits of version 3";
  }
  (*below)->StopFollowing();
  (*mirror)->StopFollowing();
}

// A stand-in relay, one server per shard, that forwards everything and, in
// every full chunk of layer `layer` it forwards, flips one bit and
// recomputes the chunk's CRC-32C: the hop's check passes, the bytes are not
// the shards'.
class FlippingRelay {
 public:
  FlippingRelay(const std::vector<std::string>& shards, uint32_t layer) {
    for (const std::string& shard : shards) {
      auto service = std::make_unique<Service>(shard, layer, flipped_);
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      builder.RegisterService(service.get());
      servers_.push_back(builder.BuildAndStart());
      addresses_.push_back(absl::StrCat("127.0.0.1:", port));
      services_.push_back(std::move(service));
    }
  }
  ~FlippingRelay() {
    for (auto& server : servers_) server->Shutdown(std::chrono::system_clock::now());
  }
  const std::vector<std::string>& addresses() const { return addresses_; }
  uint64_t flipped() const { return flipped_.load(); }

 private:
  class Service final : public layercast::v1::ShardService::Service {
   public:
    Service(const std::string& shard, uint32_t layer, std::atomic<uint64_t>& flipped)
        : stub_(layercast::v1::ShardService::NewStub(
              grpc::CreateChannel(shard, grpc::InsecureChannelCredentials()))),
          layer_(layer),
          flipped_(flipped) {}

    grpc::Status GetManifest(grpc::ServerContext* server,
                             const layercast::v1::GetManifestRequest* in,
                             layercast::v1::Manifest* out) override {
      return Forward(&Stub::GetManifest, server, *in, out);
    }
    grpc::Status WaitVersion(grpc::ServerContext* server,
                             const layercast::v1::WaitVersionRequest* in,
                             layercast::v1::WaitVersionResponse* out) override {
      return Forward(&Stub::WaitVersion, server, *in, out);
    }
    grpc::Status FetchLayer(grpc::ServerContext* server, const layercast::v1::FetchLayerRequest* in,
                            grpc::ServerWriter<layercast::v1::LayerChunk>* out) override {
      grpc::ClientContext context;
      context.set_deadline(server->deadline());
      auto upstream = stub_->FetchLayer(&context, *in);
      upstream->WaitForInitialMetadata();
      for (const auto& [key, value] : context.GetServerInitialMetadata()) {
        server->AddInitialMetadata(std::string(key.data(), key.size()),
                                   std::string(value.data(), value.size()));
      }
      layercast::v1::LayerChunk chunk;
      while (upstream->Read(&chunk)) {
        if (in->layer() == layer_ && !chunk.has_base_version() && !chunk.data().empty()) {
          std::string& data = *chunk.mutable_data();
          data[data.size() / 2] ^= 0x40;
          chunk.set_crc32c(Crc32c(data.data(), data.size()));
          flipped_.fetch_add(1);
        }
        if (!out->Write(chunk)) break;
      }
      return upstream->Finish();
    }

   private:
    using Stub = layercast::v1::ShardService::Stub;
    // A unary call passed on as it came, within the caller's deadline.
    template <typename In, typename Out>
    grpc::Status Forward(grpc::Status (Stub::*call)(grpc::ClientContext*, const In&, Out*),
                         grpc::ServerContext* server, const In& in, Out* out) {
      grpc::ClientContext context;
      context.set_deadline(server->deadline());
      return (stub_.get()->*call)(&context, in, out);
    }

    std::unique_ptr<Stub> stub_;
    const uint32_t layer_;
    std::atomic<uint64_t>& flipped_;
  };

  std::atomic<uint64_t> flipped_{0};
  std::vector<std::unique_ptr<Service>> services_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::string> addresses_;
};

// Mirrors below a relay that alters one bit of layer 1 and recomputes its
// CRC: each refuses the layer (the shards' digest differs), pulls it again
// from its fallback, the shards, and ends bit-exact; the counter says so.
TEST_F(IdentityChaosTest, MirrorsBelowARelayThatAltersABitEndWithTheShardsBits) {
  ASSERT_NO_FATAL_FAILURE(StartSet(2, ""));
  const Values published = Nudged(1.0f / 8);
  ASSERT_NO_FATAL_FAILURE(Publish(published));
  FlippingRelay relay(processes_->addresses(), 1);
  for (int m = 0; m < 2; ++m) {
    client::ShardSetOptions connect;
    connect.connect_timeout = std::chrono::seconds(30);
    connect.registry = std::make_shared<prometheus::Registry>();
    auto relayed = client::ShardSet::Connect(relay.addresses(), connect);
    ASSERT_TRUE(relayed.ok()) << relayed.status();
    client::MirrorOptions options;
    options.fallback = set_.get();
    options.verify_with = set_.get();
    const uint64_t flipped_before = relay.flipped();
    auto mirror = client::ModelMirror::Create(**relayed, options);
    ASSERT_TRUE(mirror.ok()) << mirror.status();
    EXPECT_GT(relay.flipped(), flipped_before) << "the stand-in relay altered nothing";
    EXPECT_EQ(CounterValue(*connect.registry, "layercast_client_rereads_total"), 1.0)
        << "mirror " << m << ": one layer refused and pulled again";
    auto reading = (*mirror)->Read();
    ASSERT_EQ(reading.version(), 1u);
    for (uint32_t l = 0; l < reading.num_layers(); ++l) {
      ASSERT_NO_FATAL_FAILURE(
          ExpectHolds(l, reading.layer(l).bytes(), published, absl::StrCat("mirror ", m)));
    }
  }
}

}  // namespace
}  // namespace layercast::testing
