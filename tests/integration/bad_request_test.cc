// Every malformed request gets its exact status code and a message saying
// what is valid, and the server goes on serving good requests.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "layercast/v1/shard.grpc.pb.h"
#include "tests/integration/shard_fixture.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

class BadRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    logs_ = MakeTempDir("logs");
    shards_ = StartShards(2,
                          {"--synthetic", "llama:layers=2,hidden=64,ffn=96,vocab=50", "--policy",
                           "p=f32,c=bf16;*norm*=f32", "--metrics-listen", "127.0.0.1:0"},
                          logs_);
    ASSERT_NE(shards_.set, nullptr);
    stub_ = layercast::v1::ShardService::NewStub(
        grpc::CreateChannel(shards_.processes->addresses()[0], grpc::InsecureChannelCredentials()));
  }

  // Runs FetchLayer to the end; returns its status and counts the chunks.
  grpc::Status Fetch(const layercast::v1::FetchLayerRequest& request, int* chunks = nullptr,
                     std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    auto reader = stub_->FetchLayer(&context, request);
    layercast::v1::LayerChunk chunk;
    int count = 0;
    while (reader->Read(&chunk)) ++count;
    if (chunks != nullptr) *chunks = count;
    return reader->Finish();
  }

  layercast::v1::FetchLayerRequest Request(uint32_t layer) {
    layercast::v1::FetchLayerRequest request;
    request.set_layer(layer);
    return request;
  }

  std::string logs_;  // the shards' logs, which name their metrics ports
  RunningShards shards_;
  std::unique_ptr<layercast::v1::ShardService::Stub> stub_;
};

TEST_F(BadRequestTest, EachBadRequestGetsItsCodeAndTheServerKeepsServing) {
  const uint64_t layer_bytes = shards_.set->view().layouts[1].total_bytes();
  struct Case {
    const char* what;
    layercast::v1::FetchLayerRequest request;
    grpc::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({"no such layer", Request(93), grpc::StatusCode::NOT_FOUND,
                   "layer 93 does not exist: this model has 4 layers (0-3)"});
  auto beyond = Request(1);
  beyond.set_range_begin(0);
  beyond.set_range_end(layer_bytes + 256);
  cases.push_back({"range beyond the layer", beyond, grpc::StatusCode::INVALID_ARGUMENT,
                   "within the layer's assembled size"});
  auto reversed = Request(1);
  reversed.set_range_begin(512);
  reversed.set_range_end(256);
  cases.push_back({"reversed range", reversed, grpc::StatusCode::INVALID_ARGUMENT, "non-empty"});
  auto split = Request(1);
  split.set_range_begin(0);
  split.set_range_end(257);
  cases.push_back({"range splitting an element", split, grpc::StatusCode::INVALID_ARGUMENT,
                   "splits an element"});
  auto half = Request(1);
  half.set_range_begin(256);
  cases.push_back({"half a range", half, grpc::StatusCode::INVALID_ARGUMENT, "give both ends"});
  auto wrong_dtype = Request(1);
  wrong_dtype.set_expect_dtype(layercast::v1::BFLOAT16);  // the norms are float32
  cases.push_back({"dtype against the policy", wrong_dtype, grpc::StatusCode::FAILED_PRECONDITION,
                   "gives tensor model.layers.0.input_layernorm.weight float32"});
  auto bogus_dtype = Request(1);
  bogus_dtype.set_expect_dtype(static_cast<layercast::v1::DType>(77));
  cases.push_back(
      {"unknown dtype", bogus_dtype, grpc::StatusCode::INVALID_ARGUMENT, "is not a DType"});

  for (const Case& c : cases) {
    int chunks = -1;
    const grpc::Status status = Fetch(c.request, &chunks);
    EXPECT_EQ(status.error_code(), c.code) << c.what << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message)) << c.what;
    EXPECT_EQ(chunks, 0) << c.what;
    // A good request right after each bad one is served in full.
    int good_chunks = 0;
    EXPECT_TRUE(Fetch(Request(1), &good_chunks).ok()) << "after " << c.what;
    EXPECT_GT(good_chunks, 0);
  }

  // The embedding has only bf16 tensors: expecting bf16 is accepted there.
  auto right_dtype = Request(0);
  right_dtype.set_expect_dtype(layercast::v1::BFLOAT16);
  EXPECT_TRUE(Fetch(right_dtype).ok());
  // And the whole set still gathers.
  EXPECT_TRUE(shards_.set->Gather(2).ok());
}

TEST_F(BadRequestTest, MinVersionWaitsUntilTheDeadline) {
  auto request = Request(1);
  request.set_min_version(1);  // the version is 0 and nothing advances it
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status status = Fetch(request, nullptr, std::chrono::milliseconds(400));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_GE(waited, std::chrono::milliseconds(350));
  EXPECT_LT(waited, std::chrono::seconds(5));
  request.set_min_version(0);
  EXPECT_TRUE(Fetch(request).ok());
}

TEST_F(BadRequestTest, ShardKilledMidStreamFailsTheGatherWithUnavailable) {
  // Every shard parks the stream waiting for version 1, so the kill lands
  // while all streams are open. The worker retries the dead shard until the
  // gather's deadline (it could be restarting), then fails naming it.
  client::GatherOptions options;
  options.min_version = 1;
  options.timeout = std::chrono::seconds(4);
  std::thread killer([&] {
    EXPECT_TRUE(
        AwaitShardMetric(logs_ + "/shard-1.log", "layercast_streams_waiting_for_version", 1))
        << "the gather's stream never parked on shard 1";
    shards_.processes->KillForTest(1);
  });
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<client::Layer> layer = shards_.set->Gather(1, options);
  const auto took = std::chrono::steady_clock::now() - start;
  killer.join();
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kUnavailable) << layer.status();
  EXPECT_THAT(std::string(layer.status().message()),
              HasSubstr("shard 1 (" + shards_.processes->addresses()[1] + ")"));
  EXPECT_THAT(std::string(layer.status().message()), HasSubstr("gather's deadline"));
  EXPECT_LT(took, std::chrono::seconds(8)) << "failed by the gather's deadline";
}

TEST(ShardSetTest, RefusesSetsThatDoNotAgree) {
  const std::string synthetic = "llama:layers=1,hidden=32,ffn=48,vocab=20";
  RunningShards a = StartShards(2, {"--synthetic", synthetic});
  RunningShards b = StartShards(3, {"--synthetic", synthetic});
  RunningShards other_model = StartShards(2, {"--synthetic", synthetic + ",seed=9"});
  RunningShards other_policy = StartShards(2, {"--synthetic", synthetic, "--policy", "c=f16"});
  ASSERT_NE(a.set, nullptr);
  ASSERT_NE(b.set, nullptr);
  const auto& A = a.processes->addresses();
  const auto connect = [](std::vector<std::string> addresses) {
    client::ShardSetOptions options;
    options.connect_timeout = std::chrono::seconds(20);
    return client::ShardSet::Connect(std::move(addresses), options).status();
  };
  struct Case {
    const char* what;
    std::vector<std::string> addresses;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"duplicated index", {A[0], A[0]}, "like " + A[0] + " (each index must appear exactly once)"},
      {"wrong order",
       {A[1], A[0]},
       "--shards lists the shards out of order (each reports its index); in shard order: " + A[0] +
           "," + A[1]},
      {"different shard count",
       {A[0], b.processes->addresses()[1]},
       "the shards disagree on how many shards the set has (" + A[0] + " says 2, " +
           b.processes->addresses()[1] + " says 3): restart them all with one --num-shards"},
      {"different model", {A[0], other_model.processes->addresses()[1]}, "serves model"},
      {"different policy", {A[0], other_policy.processes->addresses()[1]}, "its policy is"},
      {"too few shards",
       {A[0]},
       "every shard says the set has 2 shards, but --shards lists 1: list all 2, in shard order"},
  };
  for (const Case& c : cases) {
    const absl::Status status = connect(c.addresses);
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << c.what << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message)) << c.what;
  }
  EXPECT_TRUE(connect({A[0], A[1]}).ok());
}

// An unreachable shard is reported with its cause, not as a bare deadline.
TEST(ShardSetTest, AnUnreachableShardIsNamedWithItsCause) {
  // A port nobody listens on: bound, then closed.
  int port = 0;
  {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    socklen_t length = sizeof(address);
    ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
    port = ntohs(address.sin_port);
    close(fd);
  }
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::milliseconds(1500);
  const std::string refused = "127.0.0.1:" + std::to_string(port);
  absl::Status status = client::ShardSet::Connect({refused}, options).status();
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("shard 0 (" + refused +
                        ") did not answer within 1500 ms: connection "
                        "refused: nothing listens at " +
                        refused))
      << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("--connect-timeout-ms"));
  status = client::ShardSet::Connect({"no-such-host.invalid:7070"}, options).status();
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("no such host: the name in no-such-host.invalid:7070 does not resolve"))
      << status;
}

TEST(ShardConfigTest, ImpossibleConfigsExitBeforeBinding) {
  const std::string dir = MakeTempDir("config");
  const std::string port_file = dir + "/port";
  struct Case {
    std::string flags, message;
  };
  const std::vector<Case> cases = {
      {"--shard-index 3 --num-shards 2 --synthetic llama:", "--shard-index 3 is out of range"},
      {"--num-shards 1 --model " + dir + "/missing.safetensors", "No such file"},
      {"--num-shards 1 --synthetic llama: --policy c=bf8", "unknown dtype 'bf8'"},
      {"--num-shards 1 --synthetic llama: --cast-isa avx1024", "unknown cast kernel 'avx1024'"},
      {"--num-shards 1 --synthetic llama: --policy p=bf16", "shard servers hold float32 masters"},
      {"--num-shards 1 --synthetic llama:layers=4 --memory-budget 1MiB",
       "shard 0 of 1 needs 14.07 MiB (14754816 bytes) for its fp32 master parameters, but "
       "--memory-budget is 1.00 MiB"},
      {"--num-shards 1", "give exactly one of --model"},
      {"--num-shards 1 --synthetic llama: --frobnicate 1", "unknown flag --frobnicate"},
      {"--config " + dir + "/missing.json", "cannot read config file"},
  };
  for (const Case& c : cases) {
    std::string output;
    const int code = RunCommand(
        ShardBinary() + " --listen 127.0.0.1:0 --port-file " + port_file + " " + c.flags, &output);
    EXPECT_EQ(code, 2) << c.flags << "\n" << output;
    EXPECT_THAT(output, HasSubstr(c.message)) << c.flags;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << "one line: " << output;
    EXPECT_FALSE(std::filesystem::exists(port_file)) << "bound a port for: " << c.flags;
  }
}

// A shard without an optimizer takes no gradients: the push is refused at
// once, saying so, and the shard serves on.
TEST_F(BadRequestTest, AReadOnlyShardRefusesGradients) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  layercast::v1::PushGradientsResponse response;
  auto writer = stub_->PushGradients(&context, &response);
  layercast::v1::GradientChunk chunk;
  chunk.set_layer(1);
  chunk.set_data(std::string(4, '\0'));
  chunk.set_dtype(layercast::v1::FLOAT32);
  writer->Write(chunk);  // may fail: the shard may have answered already
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_THAT(status.error_message(),
              HasSubstr("no optimizer: it serves its parameters read-only"));
  EXPECT_TRUE(Fetch(Request(1)).ok());
}

}  // namespace
}  // namespace layercast::testing
