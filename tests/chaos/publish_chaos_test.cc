// Publishes that outlive any one participant (docs/recovery.md): the
// publisher, shard 0 (which decides) or another shard is killed at a named
// failpoint (platform/failpoint.h) and, for a shard, restarted as Kubernetes
// would, with the same flags; within a few seconds every shard serves one
// version, bit for bit, and the next publish works, with no human action.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <signal.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/weight_publisher.h"
#include "core/cast.h"
#include "tests/chaos/nudged_model.h"
#include "tests/chaos/shard_restarter.h"
#include "tests/integration/shard_fixture.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kToken[] = "chaos-token-0123456789abcdef";
constexpr int kLayers = 2;
constexpr uint64_t kSeed = 23;
// How long the set may take to come back to one version: the failpoint's
// death, a restart, and the settling (publish_idle_ms below).
constexpr auto kRecovery = std::chrono::seconds(20);

class PublishChaosTest : public ::testing::Test {
 protected:
  // Three shards, so that a shard other than the one deciding (0) and the
  // one killed is there to follow. `failpoint`, armed in the shards only,
  // fires once over the set's life: a restarted shard runs on past it.
  // `shard_flags`: flags for one shard only (LocalShardSet's).
  void StartSet(const std::string& failpoint = "",
                std::map<uint32_t, std::vector<std::string>> shard_flags = {}) {
    dir_ = MakeTempDir("set");
    model_ = WriteTestModel(dir_ + "/model.safetensors", kLayers, kSeed);
    tools::LocalShardSet::Options options;
    options.shard_binary = ShardBinary();
    options.num_shards = 3;
    options.extra_flags = {"--model",
                           model_.path,
                           "--chunk-bytes",
                           "4096",
                           "--cast-isa",
                           "widest",
                           "--publish-idle-ms",
                           "1000",
                           "--admin-token-file",
                           WriteAdminToken(dir_, kToken)};
    options.log_dir = dir_;
    options.shard_flags = std::move(shard_flags);
    if (!failpoint.empty()) {
      options.environment = {"LAYERCAST_FAILPOINT=" + failpoint,
                             "LAYERCAST_FAILPOINT_ONCE=" + dir_ + "/fired"};
    }
    auto processes = tools::LocalShardSet::Start(options);
    ASSERT_TRUE(processes.ok()) << processes.status();
    processes_ = *std::move(processes);
    client::ShardSetOptions connect;
    connect.connect_timeout = std::chrono::seconds(30);
    auto set = client::ShardSet::Connect(processes_->addresses(), connect);
    ASSERT_TRUE(set.ok()) << set.status();
    set_ = *std::move(set);
  }

  // Restarts every shard that dies, as a StatefulSet's controller would,
  // until StopRestartingAfterTheDeathAt() or the test's end.
  void RestartWhatDies() { restarter_.emplace(*processes_); }
  // Stops restarting; fails the test unless the shards' failpoint
  // `failpoint` (StartSet's) fired and killed its shard, by SIGKILL, and
  // no other shard died meanwhile.
  void StopRestartingAfterTheDeathAt(const std::string& failpoint) {
    ASSERT_TRUE(restarter_.has_value());
    restarter_->Stop();
    ExpectOnlyDeathAt(failpoint, dir_ + "/fired", restarter_->deaths());
  }
  // Every shard still running exits 0 on SIGTERM (no leak, no sanitizer
  // report); a death not by the failpoint fails the test above.
  void TearDown() override {
    if (restarter_.has_value()) restarter_->Stop();
    if (processes_ != nullptr) {
      EXPECT_EQ(processes_->Stop(), absl::OkStatus());
    }
  }

  std::vector<uint64_t> Versions() const {
    std::vector<uint64_t> versions;
    for (uint32_t shard = 0; shard < processes_->addresses().size(); ++shard) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      layercast::v1::Manifest manifest;
      const grpc::Status status = set_->stub(shard).GetManifest(&context, {}, &manifest);
      versions.push_back(status.ok() ? manifest.version() : UINT64_MAX);
    }
    return versions;
  }

  // Waits until every shard serves `version`; how long that took.
  std::chrono::milliseconds AwaitOneVersion(uint64_t version) const {
    const auto start = std::chrono::steady_clock::now();
    std::vector<uint64_t> versions;
    while (std::chrono::steady_clock::now() - start < kRecovery) {
      versions = Versions();
      if (std::all_of(versions.begin(), versions.end(), [&](uint64_t v) { return v == version; })) {
        return std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::steady_clock::now() - start);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "the shards serve versions " << absl::StrJoin(versions, ", ") << ", not all "
                  << version << ", after " << kRecovery.count() << " s";
    return kRecovery;
  }

  // Every layer gathered whole holds `values` cast to its compute dtypes.
  void ExpectServes(const std::map<std::string, std::vector<float>>& values,
                    uint64_t version) const {
    for (uint32_t l = 0; l < set_->model().layers.size(); ++l) {
      absl::StatusOr<client::Layer> layer = set_->Gather(l);
      ASSERT_TRUE(layer.ok()) << layer.status();
      EXPECT_EQ(layer->version(), version);
      const AssembledLayout& layout = set_->view().layouts[l];
      for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
        const AssembledTensor& tensor = layout.tensors()[t];
        const std::vector<float>& expected = values.at(set_->model().layers[l].tensors[t].name);
        std::vector<uint8_t> cast(expected.size() * DTypeSize(tensor.compute_dtype));
        ASSERT_TRUE(CastFromF32(expected.data(), cast.data(), expected.size(), tensor.compute_dtype,
                                Fp16Overflow::kInfinity)
                        .ok());
        ASSERT_EQ(std::memcmp(layer->bytes().data() + tensor.byte_offset, cast.data(), cast.size()),
                  0)
            << set_->model().layers[l].tensors[t].name << " at version " << version;
      }
    }
  }

  // The test model nudged by `nudge`, as the publisher process computes it.
  std::map<std::string, std::vector<float>> Nudged(float nudge) const {
    return NudgedModel(MakeTempDir("nudged") + "/model.safetensors", kLayers, kSeed, nudge);
  }

  // Runs the publisher process with `failpoint` armed in it, once; fails
  // the test unless the failpoint fired and killed it, by SIGKILL.
  void RunPublisherToItsDeathAt(float nudge, const std::string& failpoint) const {
    const std::string dir = MakeTempDir("publisher");
    const std::string fired = dir + "/fired";
    std::string output;
    // RunCommand's status, through the shell: 128 + the signal that
    // killed the publisher (which exits 0, 1 or 2 of itself).
    const int code = RunCommand(
        absl::StrCat("LAYERCAST_FAILPOINT=", failpoint, " LAYERCAST_FAILPOINT_ONCE=", fired, " ",
                     LAYERCAST_CHAOS_PUBLISHER, " ", absl::StrJoin(processes_->addresses(), ","),
                     " ", kToken, " ", kLayers, " ", kSeed, " ", nudge, " ", dir),
        &output);
    ASSERT_TRUE(std::filesystem::exists(fired))
        << "the failpoint " << failpoint << " never fired:\n"
        << output;
    ASSERT_EQ(code, 128 + SIGKILL) << output;
    EXPECT_THAT(output, HasSubstr(absl::StrCat("failpoint ", failpoint, ": killing this process")))
        << output;
  }

  absl::StatusOr<client::PublishResult> Publish(
      const std::map<std::string, std::vector<float>>& values) const {
    client::WeightPublisher publisher(
        *set_, {.admin_token = kToken, .insecure = true, .timeout = std::chrono::seconds(30)});
    client::TensorValues view;
    for (const auto& [name, tensor] : values) view.emplace(name, tensor);
    return publisher.Publish(view);
  }

  std::string dir_;
  TestModel model_;
  std::unique_ptr<tools::LocalShardSet> processes_;
  std::unique_ptr<client::ShardSet> set_;
  std::optional<ShardRestarter> restarter_;
};

// The publisher dies right after shard 0 committed: shard 0 hands the
// commit on, and every shard serves the new version.
TEST_F(PublishChaosTest, APublisherKilledAfterTheFirstCommitLeavesTheNewVersionEverywhere) {
  ASSERT_NO_FATAL_FAILURE(StartSet());
  ASSERT_NO_FATAL_FAILURE(RunPublisherToItsDeathAt(0.5f, "publish.after_first_commit"));
  const auto took = AwaitOneVersion(1);
  ASSERT_NO_FATAL_FAILURE(ExpectServes(Nudged(0.5f), 1));
  std::printf("one version %lld ms after the publisher died\n",
              static_cast<long long>(took.count()));
  const auto next = Nudged(0.25f);
  ASSERT_TRUE(Publish(next).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectServes(next, 2));
}

// The publisher dies with everything staged and nothing committed: every
// shard still serves the version before, and the next publish settles the
// dead one with the set (aborted) and commits.
TEST_F(PublishChaosTest, APublisherKilledBeforeAnyCommitLeavesTheVersionBeforeAndAWayOn) {
  ASSERT_NO_FATAL_FAILURE(StartSet());
  ASSERT_NO_FATAL_FAILURE(RunPublisherToItsDeathAt(0.5f, "publish.after_stage"));
  EXPECT_EQ(Versions(), (std::vector<uint64_t>{0, 0, 0}));
  ASSERT_NO_FATAL_FAILURE(ExpectServes(model_.values, 0));
  const auto start = std::chrono::steady_clock::now();
  const auto next = Nudged(0.25f);
  const absl::StatusOr<client::PublishResult> published = Publish(next);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(published->version, 1u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  ASSERT_NO_FATAL_FAILURE(ExpectServes(next, 1));
}

// The publisher dies with everything staged while shard 2 cannot reach
// shard 0 (its peers file names a port nothing listens on for it): shard 2
// settles the dead publish through shard 1, which heard shard 0's abort,
// and the next publish commits everywhere within seconds. (It used to ask
// shard 0 alone, for up to 10 minutes, and refuse every publish meanwhile.)
TEST_F(PublishChaosTest, ALinkCutToShard0HoldsNoPublishBack) {
  const std::string cut_peers = MakeTempDir("cut") + "/peers";  // written once the set listens
  ASSERT_NO_FATAL_FAILURE(StartSet("", {{2, {"--peers-file", cut_peers}}}));
  std::vector<std::string> addresses = processes_->addresses();
  addresses[0] = "127.0.0.1:1";
  std::ofstream(cut_peers) << absl::StrJoin(addresses, "\n") << "\n";
  ASSERT_NO_FATAL_FAILURE(RunPublisherToItsDeathAt(0.5f, "publish.after_stage"));
  const auto start = std::chrono::steady_clock::now();
  const auto next = Nudged(0.25f);
  const absl::StatusOr<client::PublishResult> published = Publish(next);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(published->version, 1u);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, std::chrono::seconds(10));
  AwaitOneVersion(1);
  ASSERT_NO_FATAL_FAILURE(ExpectServes(next, 1));
  std::printf(
      "published %lld ms after the dead publisher, one link cut\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
}

// A shard killed around its commit (`failpoint`, armed for it) and
// restarted: the publisher stages it again and the publish goes through.
class ShardKilledAtCommitTest : public PublishChaosTest,
                                public ::testing::WithParamInterface<const char*> {};

TEST_P(ShardKilledAtCommitTest, IsStagedAgainAndThePublishGoesThrough) {
  ASSERT_NO_FATAL_FAILURE(StartSet(GetParam()));
  RestartWhatDies();
  const auto values = Nudged(0.5f);
  const auto start = std::chrono::steady_clock::now();
  const absl::StatusOr<client::PublishResult> published = Publish(values);
  ASSERT_TRUE(published.ok()) << published.status();
  // Within seconds of the death (the shard is back in about 0.1 s); it
  // took 16 s while the publisher's retries failed fast.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  AwaitOneVersion(1);
  ASSERT_NO_FATAL_FAILURE(ExpectServes(values, 1));
  StopRestartingAfterTheDeathAt(GetParam());
}

// Shard 1 dies holding a whole staging, before its commit; shard 0, which
// decides, after its own commit, before it answers or hands it on; and
// shard 0 again, with its hand-on under way (the peers may take the commit
// or not) and the publisher not answered: the set ends at one version
// either way.
INSTANTIATE_TEST_SUITE_P(Points, ShardKilledAtCommitTest,
                         ::testing::Values("publish.shard_before_commit@1",
                                           "publish.shard_after_commit@0",
                                           "publish.shard_after_hand_on@0"));

// Shard 2 dies after its commit, before it answers: the publisher stages it
// again on the restarted shard. Later it dies again and comes back from the
// model file, behind the set: a publish of some layers says what to do, and
// one of every layer brings it level.
TEST_F(PublishChaosTest, AShardRestartedBehindTheSetIsBroughtLevelByTheNextPublish) {
  constexpr char kFailPoint[] = "publish.shard_after_commit@2";
  ASSERT_NO_FATAL_FAILURE(StartSet(kFailPoint));
  RestartWhatDies();
  const auto first = Nudged(0.5f);
  ASSERT_TRUE(Publish(first).ok());
  AwaitOneVersion(1);
  ASSERT_NO_FATAL_FAILURE(ExpectServes(first, 1));
  ASSERT_NO_FATAL_FAILURE(StopRestartingAfterTheDeathAt(kFailPoint));
  processes_->KillForTest(2);
  ASSERT_TRUE(processes_->RestartForTest(2).ok());
  ASSERT_EQ(Versions(), (std::vector<uint64_t>{1, 1, 0}));
  std::map<std::string, std::vector<float>> some;
  for (const TensorSpec& tensor : set_->model().layers[1].tensors) {
    some[tensor.name] = first.at(tensor.name);
  }
  const absl::StatusOr<client::PublishResult> refused = Publish(some);
  EXPECT_THAT(refused.status().message(), HasSubstr("publish every layer"));
  const auto second = Nudged(0.25f);
  const absl::StatusOr<client::PublishResult> published = Publish(second);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(published->version, 2u);
  AwaitOneVersion(2);
  ASSERT_NO_FATAL_FAILURE(ExpectServes(second, 2));
}

}  // namespace
}  // namespace layercast::testing
