// A real in-process shard server on 127.0.0.1 against clients that do what
// an attacker or a broken worker would: park more streams than --max-streams
// for versions that may never come, stop reading mid-stream, cancel while
// the version advances from another thread. A real worker's gather still
// succeeds, budget comes back, and shutdown is prompt.

#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/shard_set.h"
#include "core/synthetic_model.h"
#include "platform/clock.h"
#include "server/shard/shard_server.h"
#include "tests/in_process/bytes_beside_streams.h"

namespace layercast::server {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr char kSmallModel[] = "llama:layers=2,hidden=256,ffn=512,vocab=4096,seed=4";
// Layer 0 is 64 MiB of bf16: far more than gRPC and TCP buffer for a
// reader that stops.
constexpr char kBigModel[] = "llama:layers=1,hidden=1024,ffn=64,vocab=32768,seed=5";
constexpr uint64_t kChunkBytes = 64 << 10;

// `clock`: what the shard's timers read (it must outlive the server); null:
// the steady clock.
std::unique_ptr<ShardServer> StartServer(layercast::v1::ShardConfig config,
                                         platform::Clock* clock = nullptr) {
  config.set_listen("127.0.0.1:0");
  config.set_num_shards(1);
  if (config.chunk_bytes() == 0) config.set_chunk_bytes(kChunkBytes);
  auto settings = ResolveShardConfig(config);
  EXPECT_TRUE(settings.ok()) << settings.status();
  if (!settings.ok()) return nullptr;
  settings->clock = clock;
  auto server = ShardServer::Create(*std::move(settings));
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  EXPECT_TRUE((*server)->Start().ok());
  EXPECT_TRUE((*server)->Load(nullptr).ok());
  return *std::move(server);
}

layercast::v1::ShardConfig Config(const std::string& model) {
  layercast::v1::ShardConfig config;
  config.set_synthetic(model);
  return config;
}

// A connection of its own (no shared subchannel), as a separate client
// process would have.
std::shared_ptr<grpc::Channel> NewConnection(int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                   grpc::InsecureChannelCredentials(), args);
}

// One raw FetchLayer call that reads `read_chunks` chunks (all when
// negative) and then stops reading, as a stalled worker would.
class RawFetch final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  RawFetch(grpc::GenericStub& stub, const layercast::v1::FetchLayerRequest& request,
           int read_chunks = -1, std::optional<milliseconds> timeout = std::nullopt)
      : read_chunks_(read_chunks) {
    const std::string bytes = request.SerializeAsString();
    const grpc::Slice slice(bytes);
    request_ = grpc::ByteBuffer(&slice, 1);
    if (timeout) context_.set_deadline(std::chrono::system_clock::now() + *timeout);
    stub.PrepareBidiStreamingCall(&context_, "/layercast.v1.ShardService/FetchLayer",
                                  grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&incoming_);
    StartCall();
  }
  // gRPC calls back into the reactor until OnDone: end the call first.
  ~RawFetch() override {
    Cancel();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    ++chunks_;
    incoming_.Clear();
    if (read_chunks_ < 0 || chunks_ < read_chunks_) StartRead(&incoming_);
  }
  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;
  }

  void Cancel() { context_.TryCancel(); }
  // The call's status once it ended within `timeout`; nullopt otherwise.
  std::optional<grpc::Status> Wait(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) return std::nullopt;
    return status_;
  }
  bool done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }

 private:
  const int read_chunks_;
  grpc::ClientContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer incoming_;
  std::atomic<int> chunks_{0};
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

layercast::v1::FetchLayerRequest Request(uint32_t layer, uint64_t min_version,
                                         uint64_t range_end = 0) {
  layercast::v1::FetchLayerRequest request;
  request.set_layer(layer);
  request.set_min_version(min_version);
  if (range_end != 0) request.set_range_end(range_end);  // range_begin 0
  return request;
}

// Polls `condition` every 10 ms for up to `limit`.
template <typename Condition>
bool Eventually(Condition condition, milliseconds limit = milliseconds(30000)) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return true;
}

TEST(HostileStreamsTest, ParkedStreamsLockNoWorkerOutAndShutdownIsPrompt) {
  auto server = StartServer(Config(kSmallModel));
  ASSERT_NE(server, nullptr);
  ASSERT_EQ(server->max_streams(), 1024u);
  // 1200 streams parked for version 1 with no deadline, 100 on each of 12
  // connections: more than --max-streams.
  constexpr int kConnections = 12, kPerConnection = 100;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  std::vector<std::unique_ptr<RawFetch>> parked;
  for (int c = 0; c < kConnections; ++c) {
    channels.push_back(NewConnection(server->port()));
    stubs.push_back(std::make_unique<grpc::GenericStub>(channels.back()));
    for (int i = 0; i < kPerConnection; ++i) {
      parked.push_back(std::make_unique<RawFetch>(*stubs.back(), Request(0, 1, 256)));
    }
  }
  ASSERT_TRUE(Eventually([&] {
    return server->metrics().streams_waiting_for_version().Value() == kConnections * kPerConnection;
  })) << "parked: "
      << server->metrics().streams_waiting_for_version().Value();

  // A real worker gathers every layer meanwhile.
  auto set = client::ShardSet::Connect({"127.0.0.1:" + std::to_string(server->port())});
  ASSERT_TRUE(set.ok()) << set.status();
  for (uint32_t layer = 0; layer < (*set)->model().layers.size(); ++layer) {
    absl::StatusOr<client::Layer> gathered = (*set)->Gather(layer);
    EXPECT_TRUE(gathered.ok()) << gathered.status();
  }

  // A version that cannot come is refused at once instead of parking.
  grpc::GenericStub stub(NewConnection(server->port()));
  RawFetch impossible(stub, Request(0, UINT64_MAX));
  std::optional<grpc::Status> refused = impossible.Wait(absl::Seconds(10));
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(refused->error_message(), ::testing::HasSubstr("--max-version-lead"));

  // Shutdown with a 30 s drain ends the parked streams at once.
  const auto start = std::chrono::steady_clock::now();
  server->Shutdown(seconds(30));
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(3));
  for (auto& stream : parked) {
    std::optional<grpc::Status> status = stream->Wait(absl::Seconds(10));
    ASSERT_TRUE(status.has_value());
    EXPECT_EQ(status->error_code(), grpc::StatusCode::UNAVAILABLE) << status->error_message();
  }
}

TEST(HostileStreamsTest, ParkingIsBoundedInCountAndInTime) {
  layercast::v1::ShardConfig config = Config(kSmallModel);
  config.set_max_parked_streams(4);
  config.set_max_version_wait_ms(300);
  platform::ManualClock clock;  // the 300 ms pass when the test says so
  auto server = StartServer(config, &clock);
  ASSERT_NE(server, nullptr);
  grpc::GenericStub stub(NewConnection(server->port()));
  std::vector<std::unique_ptr<RawFetch>> parked;
  for (int i = 0; i < 4; ++i) parked.push_back(std::make_unique<RawFetch>(stub, Request(0, 1)));
  ASSERT_TRUE(
      Eventually([&] { return server->metrics().streams_waiting_for_version().Value() == 4; }));
  RawFetch fifth(stub, Request(0, 1));
  std::optional<grpc::Status> refused = fifth.Wait(absl::Seconds(10));
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused->error_message(), ::testing::HasSubstr("--max-parked-streams"));
  // No client deadline: the server's own limit ends them, at 300 ms.
  clock.Advance(milliseconds(299));
  EXPECT_EQ(server->metrics().streams_waiting_for_version().Value(), 4);
  for (auto& stream : parked) EXPECT_FALSE(stream->done());
  clock.Advance(milliseconds(1));
  for (auto& stream : parked) {
    std::optional<grpc::Status> status = stream->Wait(absl::Seconds(10));
    ASSERT_TRUE(status.has_value());
    EXPECT_EQ(status->error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_THAT(status->error_message(), ::testing::HasSubstr("--max-version-wait-ms"));
  }
  // A stream that needs no wait is served even with every parked slot used.
  for (int i = 0; i < 4; ++i) parked.push_back(std::make_unique<RawFetch>(stub, Request(0, 1)));
  RawFetch now(stub, Request(0, 0, 256));
  std::optional<grpc::Status> served = now.Wait(absl::Seconds(10));
  ASSERT_TRUE(served.has_value());
  EXPECT_TRUE(served->ok()) << served->error_message();
}

// One WaitVersion call on `channel`'s connection, on the callback API.
class VersionWait {
 public:
  VersionWait(layercast::v1::ShardService::Stub& stub, uint64_t min_version,
              milliseconds timeout = milliseconds(60000)) {
    context_.set_deadline(std::chrono::system_clock::now() + timeout);
    request_.set_min_version(min_version);
    stub.async()->WaitVersion(&context_, &request_, &response_,
                              [this](grpc::Status status) { done_.set_value(std::move(status)); });
  }
  ~VersionWait() {
    context_.TryCancel();
    future_.wait();
  }
  void Cancel() { context_.TryCancel(); }
  // The call's status once it ended within `timeout`; nullopt otherwise.
  std::optional<grpc::Status> Wait(milliseconds timeout) {
    if (future_.wait_for(timeout) != std::future_status::ready) return std::nullopt;
    return future_.get();
  }

 private:
  grpc::ClientContext context_;
  layercast::v1::WaitVersionRequest request_;
  layercast::v1::WaitVersionResponse response_;
  std::promise<grpc::Status> done_;
  std::shared_future<grpc::Status> future_ = done_.get_future().share();
};

// A client that cancels its long polls gives their slots back at once (they
// used to stay parked for the whole server-side wait, minutes, so eight
// cancelled calls shut every mirror out), and one connection cannot take
// every parked slot.
TEST(HostileStreamsTest, CancelledVersionWaitsFreeTheirSlotsAtOnce) {
  layercast::v1::ShardConfig config = Config(kSmallModel);
  config.set_max_parked_streams(8);
  config.set_max_waits_per_connection(4);
  config.set_max_version_wait_ms(120000);
  auto server = StartServer(config);
  ASSERT_NE(server, nullptr);
  std::vector<std::unique_ptr<layercast::v1::ShardService::Stub>> connections;
  for (int c = 0; c < 3; ++c) {
    connections.push_back(layercast::v1::ShardService::NewStub(NewConnection(server->port())));
  }
  std::vector<std::unique_ptr<VersionWait>> waits;
  for (int i = 0; i < 8; ++i)
    waits.push_back(std::make_unique<VersionWait>(*connections[i / 4], 1));
  ASSERT_TRUE(Eventually([&] { return server->service().streams_in_flight() == 8; }));
  // A fifth on a connection that has four is refused; so is any beyond the
  // shard's eight.
  for (int c : {0, 2}) {
    VersionWait more(*connections[c], 1);
    std::optional<grpc::Status> refused = more.Wait(milliseconds(10000));
    ASSERT_TRUE(refused.has_value());
    EXPECT_EQ(refused->error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(refused->error_message(), ::testing::HasSubstr(c == 0 ? "--max-waits-per-connection"
                                                                      : "--max-parked-streams"));
  }
  for (auto& wait : waits) wait->Cancel();
  for (auto& wait : waits) {
    std::optional<grpc::Status> status = wait->Wait(milliseconds(10000));
    ASSERT_TRUE(status.has_value());
    EXPECT_EQ(status->error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(
      Eventually([&] { return server->service().streams_in_flight() == 0; }, milliseconds(5000)))
      << "cancelled waits still hold " << server->service().streams_in_flight() << " slots";
  // A mirror's wait is parked again; at its deadline it is answered with
  // the version now.
  VersionWait mirror(*connections[2], 1, milliseconds(1000));
  std::optional<grpc::Status> answered = mirror.Wait(milliseconds(10000));
  ASSERT_TRUE(answered.has_value());
  EXPECT_TRUE(answered->ok()) << answered->error_message();
}

TEST(HostileStreamsTest, StalledReadersLoseTheirBudgetToARealWorker) {
  layercast::v1::ShardConfig config = Config(kBigModel);
  // Room for exactly two streams' chunk buffers beside the master and the
  // ledger (no change bitmaps).
  config.set_delta_versions(0);
  config.set_chunk_bytes(kChunkBytes);
  const uint64_t fixed = BytesBesideStreams(config);
  config.set_memory_budget(std::to_string(fixed + 4 * kChunkBytes));
  config.set_write_progress_timeout_ms(300);
  config.set_shared_chunk_bytes(0);
  auto server = StartServer(config);
  ASSERT_NE(server, nullptr);

  grpc::GenericStub stub(NewConnection(server->port()));
  RawFetch first(stub, Request(0, 0), /*read_chunks=*/1);
  RawFetch second(stub, Request(0, 0), /*read_chunks=*/1);
  ASSERT_TRUE(Eventually([&] { return server->budget()->in_use() == fixed + 4 * kChunkBytes; }));

  auto set = client::ShardSet::Connect({"127.0.0.1:" + std::to_string(server->port())});
  ASSERT_TRUE(set.ok()) << set.status();
  client::GatherOptions options;
  options.timeout = seconds(30);
  absl::StatusOr<client::Layer> gathered = (*set)->Gather(0, options);
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  EXPECT_EQ(gathered->tensor(0).bytes.size(), uint64_t{32768} * 1024 * 2);

  // The stalled readers' status waits in their unread messages on their
  // side; the shard has counted them out.
  EXPECT_EQ(server->metrics().streams_stalled().Value(), 2);
  // What stays: the master, and the chunk buffers the pool keeps for the
  // next casts (charged while kept).
  EXPECT_TRUE(Eventually(
      [&] { return server->budget()->in_use() == fixed + server->chunk_pool()->charged_bytes(); }));
}

// Streams park, get cancelled and finish while the version advances from
// another thread: each ends exactly once, nothing leaks, nothing hangs
// (run under AddressSanitizer in CI).
TEST(HostileStreamsTest, CancelsRacingVersionAdvancesEndEveryStreamOnce) {
  layercast::v1::ShardConfig config = Config(kSmallModel);
  config.set_max_version_lead(1 << 20);
  auto server = StartServer(config);
  ASSERT_NE(server, nullptr);
  const uint64_t master = server->budget()->in_use();
  grpc::GenericStub stub(NewConnection(server->port()));
  std::mt19937 rng(7);
  constexpr int kRounds = 40, kStreams = 24;
  int ok = 0, cancelled = 0;
  for (int round = 0; round < kRounds; ++round) {
    const uint64_t version = server->service().version_gate().version();
    std::vector<std::unique_ptr<RawFetch>> streams;
    for (int i = 0; i < kStreams; ++i) {
      streams.push_back(std::make_unique<RawFetch>(
          stub, Request(i % 2, version + 1 + i % 3, i % 4 == 0 ? 0 : 4096)));
    }
    std::thread advancer([&, delay = rng() % 3000] {
      std::this_thread::sleep_for(std::chrono::microseconds(delay));
      for (uint64_t v = version + 1; v <= version + 3; ++v) {
        server->service().version_gate().Advance(v);
      }
    });
    for (int i = 0; i < kStreams; i += 2) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
      streams[i]->Cancel();
    }
    advancer.join();
    for (auto& stream : streams) {
      std::optional<grpc::Status> status = stream->Wait(absl::Seconds(20));
      ASSERT_TRUE(status.has_value()) << "a stream never ended in round " << round;
      // ABORTED: the stream woke at one version and the layer moved on
      // while it streamed (the worker gathers again at the newer one).
      ASSERT_THAT(status->error_code(),
                  ::testing::AnyOf(grpc::StatusCode::OK, grpc::StatusCode::CANCELLED,
                                   grpc::StatusCode::ABORTED))
          << status->error_message();
      (status->ok() ? ok : cancelled) += 1;
    }
  }
  EXPECT_GT(ok, 0);
  EXPECT_GT(cancelled, 0);
  EXPECT_TRUE(Eventually([&] { return server->service().streams_in_flight() == 0; }));
  EXPECT_TRUE(Eventually([&] {
    return server->budget()->in_use() == master + server->chunk_pool()->charged_bytes();
  })) << "more than the master and the pooled chunk buffers stayed charged";
}

TEST(HostileStreamsTest, ASecondShardOnABusyPortRefusesToStart) {
  auto first = StartServer(Config(kSmallModel));
  ASSERT_NE(first, nullptr);
  layercast::v1::ShardConfig config = Config(kSmallModel);
  config.set_listen("127.0.0.1:" + std::to_string(first->port()));
  config.set_num_shards(1);
  auto settings = ResolveShardConfig(config);
  ASSERT_TRUE(settings.ok()) << settings.status();
  auto second = ShardServer::Create(*std::move(settings));
  ASSERT_TRUE(second.ok()) << second.status();
  const absl::Status started = (*second)->Start();
  EXPECT_EQ(started.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(started.message()),
              ::testing::HasSubstr("127.0.0.1:" + std::to_string(first->port())));
}

}  // namespace
}  // namespace layercast::server
