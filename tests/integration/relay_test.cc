// Relays (`layercast relay`): a relay's chunks, CRCs, versions and
// incarnations are the shards' own, full and delta; a mirror whose relay is
// killed mid-update falls back to the shards and ends bit for bit.

#include <sys/wait.h>

#include <filesystem>
#include <optional>

#include "tests/integration/publish_fixture.h"
#include "tests/integration/relay_process.h"
#include "wire/incarnation.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

// One FetchLayer stream as its reader saw it.
struct Stream {
  grpc::Status status;
  std::string incarnation;
  std::vector<std::string> chunks;  // each LayerChunk, serialised
};

Stream Read(layercast::v1::ShardService::Stub& stub,
            const layercast::v1::FetchLayerRequest& request) {
  Stream stream;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  std::unique_ptr<grpc::ClientReader<layercast::v1::LayerChunk>> reader =
      stub.FetchLayer(&context, request);
  for (layercast::v1::LayerChunk chunk; reader->Read(&chunk);) {
    stream.chunks.push_back(chunk.SerializeAsString());
  }
  stream.status = reader->Finish();
  const auto& metadata = context.GetServerInitialMetadata();
  if (auto it = metadata.find(wire::kIncarnationMetadata); it != metadata.end()) {
    stream.incarnation = std::string(it->second.data(), it->second.size());
  }
  return stream;
}

TEST_F(PublishTest, ARelayForwardsTheShardsChunksAndItsChildrenOutliveIt) {
  const std::string dir = MakeTempDir("relay");
  RelayProcess relay(dir, "relay", shards_.set->addresses(), "");
  RelayProcess dying(dir, "dying", shards_.set->addresses(), "relay.mid_delta@0");
  ASSERT_EQ(relay.addresses().size(), 2u) << relay.log();
  ASSERT_EQ(dying.addresses().size(), 2u) << dying.log();

  absl::StatusOr<std::unique_ptr<client::ShardSet>> dying_set =
      client::ShardSet::Connect(dying.addresses());
  ASSERT_TRUE(dying_set.ok()) << dying_set.status();
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> child = client::ModelMirror::Create(
      **dying_set, {.layer_timeout = std::chrono::seconds(3), .fallback = shards_.set.get()});
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ((*child)->version(), 0u);
  // A second child follows (long polls) the same relay.
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> follower =
      client::ModelMirror::Create(**dying_set, {.layer_timeout = std::chrono::seconds(3),
                                                .poll = std::chrono::seconds(2),
                                                .fallback = shards_.set.get()});
  ASSERT_TRUE(follower.ok()) << follower.status();

  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  const auto values = Nudged(1.0f / 16);
  ASSERT_TRUE(publisher.Publish(View(values)).ok());

  // Every stream of the relay, full and delta, is the shard's: chunk for
  // chunk, with its CRC, version and incarnation.
  std::vector<std::unique_ptr<layercast::v1::ShardService::Stub>> relayed;
  for (const std::string& address : relay.addresses()) {
    relayed.push_back(layercast::v1::ShardService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials())));
  }
  uint64_t delta_chunks = 0;
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    for (uint32_t s = 0; s < 2; ++s) {
      for (const bool delta : {false, true}) {
        layercast::v1::FetchLayerRequest request;
        request.set_layer(l);
        request.set_exact_version(1);  // the relay's read waits for it to land
        if (delta) {
          request.set_base_version(0);
          request.set_accepts_changed_gaps(true);
        }
        const Stream from_shard = Read(shards_.set->stub(s), request);
        const Stream from_relay = Read(*relayed[s], request);
        ASSERT_TRUE(from_shard.status.ok()) << from_shard.status.error_message();
        ASSERT_TRUE(from_relay.status.ok()) << from_relay.status.error_message();
        ASSERT_FALSE(from_relay.chunks.empty());
        EXPECT_EQ(from_relay.chunks, from_shard.chunks)
            << "layer " << l << ", shard " << s << (delta ? ", delta" : ", full");
        EXPECT_EQ(from_relay.incarnation, from_shard.incarnation);
        if (delta) delta_chunks += from_relay.chunks.size();
      }
    }
  }
  EXPECT_GT(delta_chunks, 0u);

  // A delta from a base the relay does not hold is refused as the shards
  // refuse one: pull in full.
  layercast::v1::FetchLayerRequest stale;
  stale.set_layer(0);
  stale.set_base_version(0);
  stale.set_base_incarnation(1);
  const Stream refused = Read(*relayed[0], stale);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("pull the layer in full"));

  // The child's update: its relay dies once it has sent the first chunk of
  // a delta; the child follows the shards from then on, and its layers
  // (the one torn midway too) end as the shards serve them.
  absl::StatusOr<client::MirrorUpdate> update = (*child)->Update(1);
  ASSERT_TRUE(update.ok()) << update.status();
  const std::optional<int> died = dying.WaitForExit(std::chrono::seconds(10));
  ASSERT_TRUE(died.has_value()) << "the relay did not die; see " << dying.log();
  EXPECT_TRUE(std::filesystem::exists(dying.fired()))
      << "its failpoint never fired; see " << dying.log();
  EXPECT_TRUE(KilledBySigkill(*died)) << "the relay died by " << DescribeWaitStatus(*died)
                                      << ", not by its failpoint's SIGKILL; see " << dying.log();
  EXPECT_EQ(&(*child)->source(), shards_.set.get());
  auto reading = (*child)->Read();
  EXPECT_EQ(reading.version(), 1u);
  EXPECT_TRUE(reading.status().ok()) << reading.status();
  for (uint32_t l = 0; l < reading.num_layers(); ++l) {
    ASSERT_NO_FATAL_FAILURE(ExpectHolds(reading.layer(l), values, 1));
  }

  // The follower finds its relay gone when it next polls, and follows the
  // shards to the next publish.
  (*follower)->Follow();
  const auto newer = Nudged(1.0f / 8);
  ASSERT_TRUE(publisher.Publish(View(newer)).ok());
  ASSERT_TRUE((*follower)->WaitForVersion(2, std::chrono::seconds(30)));
  EXPECT_EQ(&(*follower)->source(), shards_.set.get());
  auto followed = (*follower)->Read();
  for (uint32_t l = 0; l < followed.num_layers(); ++l) {
    ASSERT_NO_FATAL_FAILURE(ExpectHolds(followed.layer(l), newer, 2));
  }
  // A mirror created against the dead relay makes its first pull from the
  // shards.
  absl::StatusOr<std::unique_ptr<client::ModelMirror>> late = client::ModelMirror::Create(
      **dying_set, {.layer_timeout = std::chrono::seconds(3), .fallback = shards_.set.get()});
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(&(*late)->source(), shards_.set.get());
  EXPECT_EQ((*late)->version(), 2u);

  EXPECT_EQ(relay.Stop(), absl::OkStatus());
  EXPECT_EQ(shards_.processes->Stop(), absl::OkStatus());
}

// A delta larger than the values it replaces (a publish that moved nearly
// every value) is refused by a relay as by the shards, so its readers pull
// in full and never carry a bitmap on top of every value.
TEST_F(PublishTest, ARelayRefusesADeltaThatWouldOutweighTheLayerAsTheShardsDo) {
  const std::string dir = MakeTempDir("relay-dense");
  RelayProcess relay(dir, "relay", shards_.set->addresses(), "");
  ASSERT_EQ(relay.addresses().size(), 2u) << relay.log();
  client::WeightPublisher publisher(*shards_.set, {.admin_token = kToken, .insecure = true});
  const auto some = Nudged(1.0f / 16);
  auto all = some;
  for (auto& [name, tensor] : all) {
    for (float& value : tensor) value *= 1.5f;
  }
  ASSERT_TRUE(publisher.Publish(View(some)).ok());
  // The relay holds version 1 of every layer (a read of it waits for it to
  // land) before version 2 is published: else it may go from 0 to 2 and
  // never hold the base the deltas below name.
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    auto relayed = layercast::v1::ShardService::NewStub(
        grpc::CreateChannel(relay.addresses()[0], grpc::InsecureChannelCredentials()));
    layercast::v1::FetchLayerRequest request;
    request.set_layer(l);
    request.set_exact_version(1);
    const Stream landed = Read(*relayed, request);
    ASSERT_TRUE(landed.status.ok()) << "layer " << l << ": " << landed.status.error_message();
  }
  ASSERT_TRUE(publisher.Publish(View(all)).ok());
  uint32_t refused = 0;
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    for (uint32_t s = 0; s < 2; ++s) {
      auto relayed = layercast::v1::ShardService::NewStub(
          grpc::CreateChannel(relay.addresses()[s], grpc::InsecureChannelCredentials()));
      for (const uint64_t base : {0, 1}) {
        layercast::v1::FetchLayerRequest request;
        request.set_layer(l);
        request.set_exact_version(2);  // the relay's read waits for it to land
        request.set_base_version(base);
        request.set_accepts_changed_gaps(true);
        const Stream from_shard = Read(shards_.set->stub(s), request);
        const Stream from_relay = Read(*relayed, request);
        EXPECT_EQ(from_relay.status.error_code(), from_shard.status.error_code())
            << "layer " << l << ", shard " << s << ", base " << base << ": "
            << from_relay.status.error_message() << " / " << from_shard.status.error_message();
        if (from_relay.status.error_code() == grpc::StatusCode::OUT_OF_RANGE) {
          EXPECT_THAT(from_relay.status.error_message(), HasSubstr("pull the layer in full"));
          ++refused;
        }
      }
    }
  }
  // Layers 0 and 3 moved nearly every value; in the others enough stayed.
  EXPECT_GE(refused, 4u) << "the dense deltas are refused";
}

}  // namespace
}  // namespace layercast::testing
