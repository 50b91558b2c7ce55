// A real in-process shard server on 127.0.0.1 whose memory budget leaves room
// for only a few chunk buffers: concurrent fetches all complete bit-exact and
// the tracked peak never exceeds the budget; a stream that cannot get budget
// before its deadline is refused with RESOURCE_EXHAUSTED. Also what the
// server keeps between streams: shared chunks, and chunks' kept CRCs
// (the rest of the ledger: shard_server_ledger_test.cc).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "client/shard_set.h"
#include "core/cast.h"
#include "core/synthetic_model.h"
#include "server/shard/shard_server.h"
#include "tests/in_process/bytes_beside_streams.h"

namespace layercast::server {
namespace {

constexpr char kModel[] = "llama:layers=2,hidden=256,ffn=512,vocab=4096,seed=4";
constexpr uint64_t kChunkBytes = 16 << 10;

// A FetchLayer stream of layer 0 whose reader stops after one chunk: with
// the embedding far larger than flow control lets through (32 MiB of bf16
// in these tests), the stream keeps its buffers and its slot until Release.
class HeldStream {
 public:
  explicit HeldStream(layercast::v1::ShardService::Stub& stub) {
    layercast::v1::FetchLayerRequest request;
    request.set_layer(0);
    reader_ = stub.FetchLayer(&context_, request);
  }
  ~HeldStream() { Release(); }
  bool ReadOne() { return reader_->Read(&chunk_); }
  void Release() {
    if (released_) return;
    released_ = true;
    context_.TryCancel();
    while (reader_->Read(&chunk_)) {
    }
    reader_->Finish();
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<layercast::v1::LayerChunk>> reader_;
  layercast::v1::LayerChunk chunk_;
  bool released_ = false;
};

std::unique_ptr<ShardServer> StartServer(uint64_t spare_chunks, const std::string& model = kModel,
                                         std::optional<uint64_t> shared_chunk_bytes = {},
                                         uint32_t shared_chunk_max_idle_ms = 0,
                                         uint64_t cast_cache_bytes = 0) {
  layercast::v1::ShardConfig config;
  config.set_listen("127.0.0.1:0");
  config.set_num_shards(1);
  config.set_synthetic(model);
  config.set_chunk_bytes(kChunkBytes);
  // No change bitmaps: the budget is the master, the ledger and the
  // streams' chunks.
  config.set_delta_versions(0);
  config.set_memory_budget(std::to_string(BytesBesideStreams(config) + spare_chunks * kChunkBytes));
  if (shared_chunk_bytes) config.set_shared_chunk_bytes(*shared_chunk_bytes);
  config.set_shared_chunk_max_idle_ms(shared_chunk_max_idle_ms);
  config.set_cast_cache_bytes(cast_cache_bytes);
  auto settings = ResolveShardConfig(config);
  EXPECT_TRUE(settings.ok()) << settings.status();
  auto server = ShardServer::Create(*std::move(settings));
  EXPECT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE((*server)->Start().ok());
  EXPECT_TRUE((*server)->Load(nullptr).ok());
  return *std::move(server);
}

// Every tensor of `gathered` is the policy's cast of the master, bit for bit.
bool MatchesMaster(const ParameterSource& source, uint32_t layer, const client::Layer& gathered) {
  for (size_t t = 0; t < gathered.num_tensors(); ++t) {
    const client::Layer::TensorView view = gathered.tensor(t);
    std::vector<float> master(view.num_elements);
    std::vector<uint8_t> expected(view.bytes.size());
    if (!source.Read(layer, t, ElementRange{0, view.num_elements}, master).ok() ||
        !CastFromF32(master.data(), expected.data(), master.size(), view.dtype,
                     Fp16Overflow::kError)
             .ok()) {
      ADD_FAILURE() << "cannot compute the expected bytes of " << view.name;
      return false;
    }
    if (std::memcmp(expected.data(), view.bytes.data(), expected.size()) != 0) {
      ADD_FAILURE() << "tensor " << view.name << " of layer " << layer << " differs";
      return false;
    }
  }
  return true;
}

TEST(ShardServerBudgetTest, ConcurrentFetchesCompleteExactlyWithinTheBudget) {
  // Room for two streams (each holds two chunks) beside the master and the
  // ledger.
  auto server = StartServer(4);
  const uint64_t budget = *server->budget()->budget();
  auto set = client::ShardSet::Connect({"127.0.0.1:" + std::to_string(server->port())});
  ASSERT_TRUE(set.ok()) << set.status();
  auto source = SyntheticModel::Create(kModel);

  constexpr int kWorkers = 12;
  std::vector<std::thread> workers;
  std::atomic<int> exact{0}, failed{0};
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      const uint32_t layer = static_cast<uint32_t>(w % (*set)->model().layers.size());
      absl::StatusOr<client::Layer> gathered = (*set)->Gather(layer);
      if (!gathered.ok()) {
        ADD_FAILURE() << gathered.status();
        ++failed;
        return;
      }
      if (MatchesMaster(**source, layer, *gathered)) ++exact;
    });
  }
  for (auto& worker : workers) worker.join();
  EXPECT_EQ(exact.load(), kWorkers);
  EXPECT_EQ(failed.load(), 0);
  EXPECT_LE(server->budget()->peak(), budget);
  EXPECT_GT(server->budget()->peak(), server->budget()->in_use()) << "chunk buffers were counted";
  // A reclaimer posted during the run may still be dropping kept chunks on
  // the budget's thread: wait for the two counts to settle.
  // The master and the ledger: the budget less the four chunks left.
  const uint64_t fixed = budget - 4 * kChunkBytes;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  const auto kept = [&] {
    return server->shared_chunks()->kept_bytes() + server->chunk_pool()->charged_bytes();
  };
  while (server->budget()->in_use() != fixed + kept() &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(server->budget()->in_use(), fixed + kept())
      << "only the master, the ledger, the chunks kept for sharing and the pooled chunk "
         "buffers remain";
  server->Shutdown(std::chrono::seconds(5));
}

TEST(ShardServerBudgetTest, AStreamThatCannotStartBeforeItsDeadlineIsRefused) {
  // Room for exactly one stream.
  auto server = StartServer(2, "llama:layers=1,hidden=256,ffn=64,vocab=65536");
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = layercast::v1::ShardService::NewStub(channel);

  HeldStream holder(*stub);
  ASSERT_TRUE(holder.ReadOne());

  grpc::ClientContext context;
  layercast::v1::FetchLayerRequest request;
  layercast::v1::LayerChunk chunk;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(800));
  request.set_layer(1);
  auto refused = stub->FetchLayer(&context, request);
  while (refused->Read(&chunk)) {
  }
  const grpc::Status status = refused->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("no memory budget became free"));
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("raise --memory-budget"));

  holder.Release();
  EXPECT_LE(server->budget()->peak(), *server->budget()->budget());
  server->Shutdown(std::chrono::seconds(5));
}

TEST(ShardServerBudgetTest, StreamsBeyondMaxStreamsAreRefused) {
  layercast::v1::ShardConfig config;
  config.set_listen("127.0.0.1:0");
  config.set_num_shards(1);
  config.set_synthetic("llama:layers=1,hidden=256,ffn=64,vocab=65536");
  config.set_max_streams(1);
  auto server = ShardServer::Create(*ResolveShardConfig(config));
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  ASSERT_TRUE((*server)->Load(nullptr).ok());
  auto stub = layercast::v1::ShardService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  HeldStream holder(*stub);
  ASSERT_TRUE(holder.ReadOne());

  grpc::ClientContext context;
  layercast::v1::FetchLayerRequest request;
  layercast::v1::LayerChunk chunk;
  request.set_layer(1);
  auto refused = stub->FetchLayer(&context, request);
  while (refused->Read(&chunk)) {
  }
  const grpc::Status status = refused->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("already serves 1 FetchLayer"));
  holder.Release();
  (*server)->Shutdown(std::chrono::seconds(5));
}

TEST(ShardServerBudgetTest, ABudgetThatCannotServeOneStreamFailsAtStart) {
  layercast::v1::ShardConfig config;
  config.set_num_shards(1);
  config.set_synthetic(kModel);
  config.set_chunk_bytes(kChunkBytes);
  config.set_delta_versions(0);
  config.set_memory_budget(std::to_string(BytesBesideStreams(config) + kChunkBytes));
  auto server = ShardServer::Create(*ResolveShardConfig(config));
  EXPECT_EQ(server.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(server.status().message()),
              ::testing::HasSubstr("but it needs 32.00 KiB for one stream (twice --chunk-bytes)"));
}

// Cast once, send to many (SharedChunks) over real gRPC streams.

// Each worker has its own connections, as separate processes would.
absl::StatusOr<std::unique_ptr<client::ShardSet>> Connect(const ShardServer& server) {
  return client::ShardSet::Connect({"127.0.0.1:" + std::to_string(server.port())});
}

// A new worker (connections of its own) gathers `layer`: the master's
// cast, bit for bit.
void GatherAsNewWorker(const ShardServer& server, const ParameterSource& source, uint32_t layer) {
  auto set = Connect(server);
  ASSERT_TRUE(set.ok()) << set.status();
  absl::StatusOr<client::Layer> gathered = (*set)->Gather(layer);
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  EXPECT_TRUE(MatchesMaster(source, layer, *gathered));
}

// A worker's stream of `layer` that reads what it is asked to and no more:
// open, and another reader of the layer, until it goes.
class StalledStream {
 public:
  StalledStream(const ShardServer& server, uint32_t layer)
      : stub_(layercast::v1::ShardService::NewStub(grpc::CreateChannel(
            "127.0.0.1:" + std::to_string(server.port()), grpc::InsecureChannelCredentials()))) {
    layercast::v1::FetchLayerRequest request;
    request.set_layer(layer);
    reader_ = stub_->FetchLayer(&context_, request);
  }
  ~StalledStream() { Close(); }

  // Cancels the stream (before the server is shut down: it would wait for
  // the stream's drain).
  void Close() {
    if (reader_ == nullptr) return;
    context_.TryCancel();
    layercast::v1::LayerChunk chunk;
    for (int i = 0; i < 100'000 && reader_->Read(&chunk); ++i) {
    }
    reader_->Finish();
    reader_ = nullptr;
  }

  bool ReadOne() {
    layercast::v1::LayerChunk chunk;
    return reader_->Read(&chunk);
  }

 private:
  std::unique_ptr<layercast::v1::ShardService::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<layercast::v1::LayerChunk>> reader_;
};

TEST(ShardServerSharingTest, AWorkerBehindAnotherSendsEveryChunkItCast) {
  // The embedding is 32 MiB of bfloat16: a stream whose reader stalls stays
  // open, far beyond what flow control lets through.
  const std::string model = "llama:layers=1,hidden=256,ffn=64,vocab=65536,seed=5";
  // Kept chunks outlive a slow gather here (a sanitizer build on a busy
  // machine), so "nothing was cast again" holds however long it takes.
  auto server = StartServer(8192, model, 64 << 20, /*shared_chunk_max_idle_ms=*/600'000);
  auto source = SyntheticModel::Create(model);
  const ServerMetrics& metrics = server->metrics();
  constexpr uint32_t kLayer = 0;

  // Alone, a worker's chunks are not worth keeping.
  auto first = Connect(*server);
  ASSERT_TRUE(first.ok()) << first.status();
  auto gathered = (*first)->Gather(kLayer);
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  ASSERT_TRUE(MatchesMaster(**source, kLayer, *gathered));
  const double chunks = metrics.chunks_cast().Value();
  ASSERT_GT(chunks, 1);
  EXPECT_EQ(server->shared_chunks()->kept_bytes(), 0u);

  // With a third worker's stream of the layer open, the first worker's
  // casts are kept and the second worker casts nothing.
  StalledStream stalled(*server, kLayer);
  ASSERT_TRUE(stalled.ReadOne());

  const double cast_before = metrics.chunks_cast().Value();
  gathered = (*first)->Gather(kLayer);
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  ASSERT_TRUE(MatchesMaster(**source, kLayer, *gathered));
  const double shared_before = metrics.chunks_shared().Value();
  const double cast_after_first = metrics.chunks_cast().Value();
  EXPECT_GT(cast_after_first, cast_before);

  ASSERT_NO_FATAL_FAILURE(GatherAsNewWorker(*server, **source, kLayer));
  EXPECT_EQ(metrics.chunks_cast().Value(), cast_after_first) << "nothing was cast again";
  EXPECT_EQ(metrics.chunks_shared().Value() - shared_before, chunks);
  EXPECT_LE(server->budget()->peak(), *server->budget()->budget());

  stalled.Close();
  server->Shutdown(std::chrono::seconds(5));
}

TEST(ShardServerSharingTest, ChunksCastIntoTheCastCacheAreNotKeptTwice) {
  const std::string model = "llama:layers=1,hidden=256,ffn=64,vocab=65536,seed=5";
  // 128 MiB beside the streams: the cache takes the 32 MiB embedding with
  // as much again free beside it.
  auto server = StartServer(8192, model, 64 << 20, /*shared_chunk_max_idle_ms=*/600'000,
                            /*cast_cache_bytes=*/1 << 30);
  auto source = SyntheticModel::Create(model);
  const ServerMetrics& metrics = server->metrics();
  constexpr uint32_t kLayer = 0;

  // A third worker's stream of the layer stays open: chunks cast now would
  // be kept for it, were the cache not keeping them already.
  StalledStream stalled(*server, kLayer);
  ASSERT_TRUE(stalled.ReadOne());
  // Until flow control stops it: a chunk it is casting would be cast again.
  double cast = -1;
  for (int i = 0; i < 100 && metrics.chunks_cast().Value() != cast; ++i) {
    cast = metrics.chunks_cast().Value();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  ASSERT_NO_FATAL_FAILURE(GatherAsNewWorker(*server, **source, kLayer));
  EXPECT_EQ(server->shared_chunks()->kept_bytes(), 0u) << "kept beside the cache's copy";

  const double cast_after_first = metrics.chunks_cast().Value();
  const double cached_before = metrics.chunks_cached().Value();
  ASSERT_NO_FATAL_FAILURE(GatherAsNewWorker(*server, **source, kLayer));
  EXPECT_EQ(metrics.chunks_cast().Value(), cast_after_first) << "nothing was cast again";
  EXPECT_GT(metrics.chunks_cached().Value(), cached_before);
  EXPECT_EQ(server->shared_chunks()->kept_bytes(), 0u);

  stalled.Close();
  server->Shutdown(std::chrono::seconds(5));
}

TEST(ShardServerSharingTest, ConcurrentWorkersOnOneModelGetIdenticalExactBytes) {
  auto server = StartServer(1024, kModel, 8 << 20);
  auto source = SyntheticModel::Create(kModel);
  constexpr int kWorkers = 6;
  std::vector<std::unique_ptr<client::ShardSet>> sets;
  for (int w = 0; w < kWorkers; ++w) {
    auto set = Connect(*server);
    ASSERT_TRUE(set.ok()) << set.status();
    sets.push_back(*std::move(set));
  }
  const uint32_t layers = static_cast<uint32_t>(sets[0]->model().layers.size());
  std::atomic<int> exact{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      for (uint32_t layer = 0; layer < layers; ++layer) {
        absl::StatusOr<client::Layer> gathered = sets[w]->Gather(layer);
        if (!gathered.ok()) {
          ADD_FAILURE() << gathered.status();
          return;
        }
        if (MatchesMaster(**source, layer, *gathered)) ++exact;
      }
    });
  }
  for (auto& worker : workers) worker.join();
  EXPECT_EQ(exact.load(), kWorkers * static_cast<int>(layers));
  const ServerMetrics& metrics = server->metrics();
  // How many depends on how the threads overlap: a chunk cast before a
  // second stream of its layer opened was not kept.
  EXPECT_GT(metrics.chunks_shared().Value(), 0) << "workers on one layer share casts";
  EXPECT_LE(server->budget()->peak(), *server->budget()->budget());
  server->Shutdown(std::chrono::seconds(5));
}

TEST(ShardServerSharingTest, ASlowOrCancelledWorkerDoesNotHoldTheOthersBack) {
  // Room for the two stalled streams, four workers and some shared chunks.
  auto server = StartServer(24, kModel);
  auto source = SyntheticModel::Create(kModel);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = layercast::v1::ShardService::NewStub(channel);
  layercast::v1::FetchLayerRequest request;
  request.set_layer(0);  // the embedding: 2 MiB of bfloat16, far beyond flow control's window

  // One worker reads a chunk and stalls; another reads a chunk and cancels.
  grpc::ClientContext slow_context, cancelled_context;
  auto slow = stub->FetchLayer(&slow_context, request);
  auto cancelled = stub->FetchLayer(&cancelled_context, request);
  layercast::v1::LayerChunk chunk;
  ASSERT_TRUE(slow->Read(&chunk));
  ASSERT_TRUE(cancelled->Read(&chunk));
  cancelled_context.TryCancel();

  constexpr int kWorkers = 4;
  std::atomic<int> exact{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&] {
      auto set = Connect(*server);
      ASSERT_TRUE(set.ok()) << set.status();
      client::GatherOptions options;
      options.timeout = std::chrono::seconds(20);
      absl::StatusOr<client::Layer> gathered = (*set)->Gather(0, options);
      ASSERT_TRUE(gathered.ok()) << gathered.status();
      if (MatchesMaster(**source, 0, *gathered)) ++exact;
    });
  }
  for (auto& worker : workers) worker.join();
  EXPECT_EQ(exact.load(), kWorkers);
  EXPECT_LE(server->budget()->peak(), *server->budget()->budget());

  while (cancelled->Read(&chunk)) {
  }
  EXPECT_EQ(cancelled->Finish().error_code(), grpc::StatusCode::CANCELLED);
  slow_context.TryCancel();
  while (slow->Read(&chunk)) {
  }
  slow->Finish();
  server->Shutdown(std::chrono::seconds(5));
}

// The CRC a shard keeps for a chunk (CastErrorLedger) went bad after the
// chunk's first cast: every stream sending the chunk with it fails the
// worker's check, until the worker's retry asks for a fresh cast. That
// stream checksums what it casts, the worker gets the layer, and the shard
// keeps the right CRC again.
TEST(ShardServerKeptCrcTest, AWorkersRecastMendsABadKeptCrc) {
  // No shared chunks: a kept slice would carry the CRC of its own cast.
  auto server = StartServer(8, kModel, /*shared_chunk_bytes=*/0);
  auto set = Connect(*server);
  ASSERT_TRUE(set.ok()) << set.status();
  auto source = SyntheticModel::Create(kModel);
  // Counts the retries after a failed checksum, and fails fast without one.
  std::atomic<int> data_loss_retries{0};
  client::GatherOptions options;
  options.timeout = std::chrono::seconds(20);
  options.on_retry = [&](const absl::Status& why, std::chrono::milliseconds) {
    if (absl::IsDataLoss(why)) ++data_loss_retries;
  };
  absl::StatusOr<client::Layer> first = (*set)->Gather(0, options);
  ASSERT_TRUE(first.ok()) << first.status();
  const client::Layer::TensorView tensor = first->tensor(0);
  // The tensor's first chunk, as the shard keys it.
  const ChunkKey key{
      .layer = 0,
      .tensor = 0,
      .element_begin = 0,
      .elements = std::min<uint64_t>(kChunkBytes / DTypeSize(tensor.dtype), tensor.num_elements),
      .version = first->version(),
      .dtype = tensor.dtype};
  const std::optional<CastErrorLedger::Known> kept = server->cast_errors().Find(key);
  ASSERT_TRUE(kept.has_value() && kept->crc32c.has_value())
      << "the first gather kept the chunk's CRC";
  ASSERT_TRUE(server->cast_errors().ReplaceCrc(key, ~*kept->crc32c));

  absl::StatusOr<client::Layer> again = (*set)->Gather(0, options);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(MatchesMaster(**source, 0, *again));
  EXPECT_EQ(data_loss_retries.load(), 1) << "the bad CRC failed one stream, and the recast none";
  const std::optional<CastErrorLedger::Known> mended = server->cast_errors().Find(key);
  ASSERT_TRUE(mended.has_value());
  EXPECT_EQ(mended->crc32c, kept->crc32c) << "the fresh cast's CRC replaced the bad one";
  absl::StatusOr<client::Layer> third = (*set)->Gather(0, options);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_TRUE(MatchesMaster(**source, 0, *third));
  EXPECT_EQ(data_loss_retries.load(), 1) << "the mended CRC fails no stream";
  server->Shutdown(std::chrono::seconds(5));
}

}  // namespace
}  // namespace layercast::server
