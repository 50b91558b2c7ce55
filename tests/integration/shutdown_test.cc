// Health and graceful shutdown of real shard processes: readiness follows
// loading and draining; SIGTERM lets streams in flight finish, refuses new
// ones, and exits 0; the drain timeout bounds it; SIGTERM while loading exits
// at once, and so does SIGTERM the instant the shard listens.

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"

#include "grpc/health/v1/health.grpc.pb.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "tests/integration/shard_fixture.h"

namespace layercast::testing {
namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

// The health status of `service`, or UNKNOWN with the RPC's error.
HealthCheckResponse::ServingStatus Health(const std::string& address, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  if (!stub->Check(&context, request, &response).ok()) return HealthCheckResponse::UNKNOWN;
  return response.status();
}

TEST(ShutdownTest, ReadinessNotServingWhileLoadingAndSigtermExitsPromptly) {
  // ~3.6 GiB of fp32 on one shard: loading takes seconds.
  auto shards =
      StartProcesses(1, {"--synthetic", "llama:layers=16,hidden=2048,ffn=5632,vocab=32000"});
  ASSERT_NE(shards, nullptr);
  const std::string address = shards->addresses()[0];
  EXPECT_EQ(Health(address, ""), HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(address, "layercast.v1.ShardService"), HealthCheckResponse::NOT_SERVING);

  auto stub = layercast::v1::ShardService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  layercast::v1::Manifest manifest;
  const grpc::Status loading = stub->GetManifest(&context, {}, &manifest);
  EXPECT_EQ(loading.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(loading.error_message(), ::testing::HasSubstr("still loading"));

  const auto start = std::chrono::steady_clock::now();
  shards->SignalForTest(0, SIGTERM);
  absl::StatusOr<int> code = shards->WaitForExitForTest(0, std::chrono::seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
}

TEST(ShutdownTest, SigtermTheMomentThePortFileAppearsExitsCleanly) {
  // A supervisor may stop a shard as soon as it listens. The port file is
  // written once the shard listens, so a signal sent the instant it appears
  // must find the shard's handler in place, not the default action.
  // LocalShardSet polls for the file every 10 ms and would miss that moment,
  // so this test spawns the shard itself and spins on the file.
  const std::string dir = MakeTempDir("sigterm_at_start");
  for (int round = 0; round < 5; ++round) {
    const std::string port_file = absl::StrCat(dir, "/port-", round);
    std::vector<std::string> args = {ShardBinary(),
                                     "--num-shards",
                                     "1",
                                     "--shard-index",
                                     "0",
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--port-file",
                                     port_file,
                                     "--synthetic",
                                     "llama:layers=2,hidden=64,ffn=128,vocab=256"};
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    const std::string log = absl::StrCat(dir, "/shard-", round, ".log");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addclosefrom_np(&actions, STDERR_FILENO + 1);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
    pid_t pid = 0;
    const int spawned = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ASSERT_EQ(spawned, 0) << std::strerror(spawned);

    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    int status = 0;
    bool listening = false;
    std::error_code error;
    while (std::chrono::steady_clock::now() < deadline) {
      if (std::filesystem::exists(port_file, error)) {
        listening = true;
        break;
      }
      ASSERT_NE(waitpid(pid, &status, WNOHANG), pid)
          << "the shard exited before listening; see " << log;
      sched_yield();  // no sleep: the signal must come the instant the file appears
    }
    if (!listening) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      FAIL() << "the shard wrote no port file within 60 s; see " << log;
    }
    kill(pid, SIGTERM);
    const auto stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (waitpid(pid, &status, WNOHANG) != pid) {
      if (std::chrono::steady_clock::now() >= stop_deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        FAIL() << "round " << round << ": the shard did not stop within 30 s of SIGTERM; see "
               << log;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "round " << round << ": "
        << (WIFSIGNALED(status) ? absl::StrCat("killed by signal ", WTERMSIG(status))
                                : absl::StrCat("exit ", WEXITSTATUS(status)))
        << "; see " << log;
  }
}

TEST(ShutdownTest, SigtermDrainsStreamsInFlightAndRefusesNewOnes) {
  // The embedding layer is 64 MiB of bf16 per shard: more than gRPC buffers,
  // so a slow reader keeps the stream in flight while the signal arrives.
  auto shards = StartProcesses(1, {"--synthetic", "llama:layers=1,hidden=1024,ffn=64,vocab=32768"});
  ASSERT_NE(shards, nullptr);
  const std::string address = shards->addresses()[0];
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::seconds(60);
  auto set = client::ShardSet::Connect(shards->addresses(), connect);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(Health(address, "layercast.v1.ShardService"), HealthCheckResponse::SERVING);

  auto stub = layercast::v1::ShardService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  layercast::v1::FetchLayerRequest request;
  request.set_layer(0);
  auto reader = stub->FetchLayer(&context, request);
  layercast::v1::LayerChunk chunk;
  uint64_t bytes = 0;
  int chunks = 0;
  ASSERT_TRUE(reader->Read(&chunk));
  bytes += chunk.data().size();

  shards->SignalForTest(0, SIGTERM);
  // Draining once its health says so (bounded).
  for (const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       Health(address, "layercast.v1.ShardService") == HealthCheckResponse::SERVING &&
       std::chrono::steady_clock::now() < give_up;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // A new stream is refused while the old one drains.
  {
    auto fresh = layercast::v1::ShardService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext other;
    other.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    auto refused = fresh->FetchLayer(&other, request);
    layercast::v1::LayerChunk ignored;
    while (refused->Read(&ignored)) {
    }
    EXPECT_EQ(refused->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  while (reader->Read(&chunk)) {
    bytes += chunk.data().size();
    if (++chunks % 8 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const grpc::Status finished = reader->Finish();
  EXPECT_TRUE(finished.ok()) << finished.error_message();
  EXPECT_EQ(bytes, uint64_t{32768} * 1024 * 2) << "the stream in flight was delivered in full";
  absl::StatusOr<int> code = shards->WaitForExitForTest(0, std::chrono::seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

TEST(ShutdownTest, SigtermEndsParkedStreamsAtOnceAndTheWorkerWaitsForTheShard) {
  const std::string logs = MakeTempDir("logs");
  auto shards = StartProcesses(1,
                               {"--synthetic", "llama:layers=1,hidden=64",
                                "--drain-timeout-seconds", "20", "--metrics-listen", "127.0.0.1:0"},
                               logs);
  ASSERT_NE(shards, nullptr);
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::seconds(60);
  auto set = client::ShardSet::Connect(shards->addresses(), connect);
  ASSERT_TRUE(set.ok()) << set.status();

  // Parked until version 5, which never comes.
  client::GatherOptions options;
  options.min_version = 5;
  options.timeout = std::chrono::seconds(4);
  std::atomic<int> retries{0};
  std::string first_retry;
  options.on_retry = [&](const absl::Status& why, std::chrono::milliseconds) {
    if (retries++ == 0) first_retry = std::string(why.message());
  };
  absl::StatusOr<client::Layer> parked;
  std::thread gather([&] { parked = (*set)->Gather(0, options); });
  EXPECT_TRUE(AwaitShardMetric(logs + "/shard-0.log", "layercast_streams_waiting_for_version", 1))
      << "the stream never parked";
  const auto start = std::chrono::steady_clock::now();
  shards->SignalForTest(0, SIGTERM);
  absl::StatusOr<int> code = shards->WaitForExitForTest(0, std::chrono::seconds(10));
  // Well within the 20 s drain timeout: a parked stream holds no drain.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  // The worker retries the vanished shard until its deadline, saying why.
  gather.join();
  EXPECT_FALSE(parked.ok());
  EXPECT_THAT(parked.status().code(), ::testing::AnyOf(absl::StatusCode::kUnavailable,
                                                       absl::StatusCode::kDeadlineExceeded));
  EXPECT_GE(retries.load(), 1);
  EXPECT_THAT(first_retry, ::testing::HasSubstr("shutting down"));
}

}  // namespace
}  // namespace layercast::testing
