// Training shards as real processes: pushes count exactly once, hostile
// pushes change nothing and give their budget back, a layer's version
// advances when every worker has pushed it, reads never mix versions, and a
// pinned read gets the version a step superseded.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/gradient_sink.h"
#include "core/layout.h"
#include "core/safetensors_source.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "platform/byte_size.h"
#include "server/shard/memory_plan.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"
#include "tests/sanitized_build.h"
#include "tools/synthetic_gradient.h"
#include "wire/gradient_chunks.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kPolicy[] = "p=f32,c=bf16;*norm*=f32";
constexpr char kOptimizer[] = "sgd:lr=0.5";
constexpr char kMomentum[] = "sgd:lr=0.5,momentum=0.9";
constexpr uint64_t kChunkBytes = 4096;

// One worker's gradient of one layer for one shard, as GradientChunks.
std::vector<layercast::v1::GradientChunk> Chunks(const client::ShardSet& set, uint32_t layer,
                                                 uint32_t worker, uint64_t step, uint32_t shard) {
  const AssembledLayout& layout = set.view().gradient_layouts[layer];
  std::vector<uint8_t> gradient(layout.total_bytes());
  EXPECT_TRUE(tools::FillSyntheticGradient(layout, worker, step, layer, gradient).ok());
  wire::GradientChunker chunker(
      layout, gradient, {step, worker, layer, shard, static_cast<uint32_t>(set.addresses().size())},
      kChunkBytes);
  std::vector<layercast::v1::GradientChunk> chunks;
  layercast::v1::GradientChunk chunk;
  while (chunker.Next(&chunk)) chunks.push_back(chunk);
  return chunks;
}

struct PushOutcome {
  grpc::Status status;
  layercast::v1::PushGradientsResponse response;
};

// Sends `chunks` on one PushGradients stream to shard `shard` and
// half-closes it.
PushOutcome Push(const client::ShardSet& set, uint32_t shard,
                 const std::vector<layercast::v1::GradientChunk>& chunks,
                 const std::string& token = "") {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  PushOutcome outcome;
  auto writer = set.stub(shard).PushGradients(&context, &outcome.response);
  for (const auto& chunk : chunks) {
    if (!writer->Write(chunk)) break;
  }
  writer->WritesDone();
  outcome.status = writer->Finish();
  return outcome;
}

// Push, retried while an earlier stream of the same push is still in
// flight on the shard (ABORTED): a worker told its stream was cut off or
// cancelled may be quicker than the shard's clean-up of it, as the worker
// library's retries are.
PushOutcome PushOnceAdmitted(const client::ShardSet& set, uint32_t shard,
                             const std::vector<layercast::v1::GradientChunk>& chunks) {
  PushOutcome outcome;
  for (int attempt = 0; attempt < 100; ++attempt) {
    outcome = Push(set, shard, chunks);
    if (outcome.status.error_code() != grpc::StatusCode::ABORTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return outcome;
}

uint64_t LayerVersion(const client::ShardSet& set, uint32_t layer) {
  absl::StatusOr<client::Layer> gathered = set.Gather(layer);
  EXPECT_TRUE(gathered.ok()) << gathered.status();
  return gathered.ok() ? gathered->version() : UINT64_MAX;
}

class TrainingTest : public ::testing::Test {
 protected:
  void Start(uint32_t num_shards, uint32_t workers, std::vector<std::string> extra = {},
             const std::string& optimizer = kOptimizer) {
    model_ = WriteTestModel(MakeTempDir("training") + "/model.safetensors", 2, 5);
    std::vector<std::string> flags = {"--model",
                                      model_.path,
                                      "--policy",
                                      kPolicy,
                                      "--optimizer",
                                      optimizer,
                                      "--data-parallel-workers",
                                      std::to_string(workers),
                                      "--chunk-bytes",
                                      std::to_string(kChunkBytes)};
    flags.insert(flags.end(), extra.begin(), extra.end());
    shards_ = StartShards(num_shards, flags);
    ASSERT_NE(shards_.set, nullptr);
  }

  // One shard, W workers, and a budget with room for the master, one step
  // of the largest layer (W pushes), one stream and the cast-error ledger,
  // no more.
  void StartWithRoomForOneStep(uint32_t workers, std::vector<std::string> extra = {}) {
    ASSERT_NO_FATAL_FAILURE(Start(1, workers));
    uint64_t master = 0, largest = 0;
    for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
      uint64_t elements = 0;
      for (const TensorSpec& tensor : shards_.set->model().layers[l].tensors) {
        elements += tensor.num_elements;
      }
      master += 4 * elements;
      if (4 * elements > largest) largest = 4 * elements, largest_layer_ = l;
    }
    ASSERT_EQ(shards_.processes->Stop(), absl::OkStatus());
    // The cast-error ledger's record for each chunk, as the shard's plan
    // counts it.
    auto source = SafetensorsSource::Open(model_.path, "");
    ASSERT_TRUE(source.ok()) << source.status();
    const absl::StatusOr<server::MemoryPlan> plan =
        server::PlanShardMemory((*source)->model(), *Policy::Parse(kPolicy), 0, 1, kChunkBytes,
                                /*delta_versions=*/0, std::nullopt);
    ASSERT_TRUE(plan.ok()) << plan.status();
    extra.insert(extra.end(),
                 {"--memory-budget",
                  std::to_string(master + workers * largest + 3 * kChunkBytes + plan->ledger_bytes),
                  // no change bitmaps: the budget is exactly the above
                  "--delta-versions", "0"});
    ASSERT_NO_FATAL_FAILURE(Start(1, workers, extra));
  }

  TestModel model_;
  RunningShards shards_;
  uint32_t largest_layer_ = 0;
};

TEST_F(TrainingTest, HostilePushesAreRefusedAndChangeNothing) {
  ASSERT_NO_FATAL_FAILURE(Start(2, 2));
  const client::ShardSet& set = *shards_.set;
  const std::vector<layercast::v1::GradientChunk> good = Chunks(set, 1, 0, 0, 0);
  ASSERT_GE(good.size(), 3u);

  // Wrong step: the layer is at version 0.
  PushOutcome outcome = Push(set, 0, Chunks(set, 1, 0, 1, 0));
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(outcome.status.error_message(),
              HasSubstr("step 1 of layer 1, which is at version 0"));

  // A worker the shard set does not train with.
  outcome = Push(set, 0, Chunks(set, 1, 2, 0, 0));
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("worker 2 is out of range"));

  // No such layer.
  std::vector<layercast::v1::GradientChunk> bad = good;
  for (auto& chunk : bad) chunk.set_layer(99);
  EXPECT_EQ(Push(set, 0, bad).status.error_code(), grpc::StatusCode::NOT_FOUND);

  // Short stream: it ends before every owned element arrived.
  outcome = Push(set, 0, {good.begin(), good.end() - 1});
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("ended before every element"));

  // Overlapping ranges: a chunk sent twice.
  bad = good;
  bad.insert(bad.begin() + 1, good[0]);
  EXPECT_EQ(Push(set, 0, bad).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // A corrupted chunk.
  bad = good;
  bad[1].mutable_data()->at(0) ^= 1;
  EXPECT_EQ(Push(set, 0, bad).status.error_code(), grpc::StatusCode::DATA_LOSS);

  // An empty stream.
  EXPECT_EQ(Push(set, 0, {}).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // None of that staged anything: worker 0's real push is its first, and
  // the step waits for worker 1.
  outcome = Push(set, 0, good);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_FALSE(outcome.response.applied());
  EXPECT_EQ(outcome.response.layer_version(), 0u);

  // The same push again counts once.
  outcome = Push(set, 0, good);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("it counts once"));

  // Worker 1 completes shard 0's step; shard 1 still has none, so the
  // model stays at version 0 while shard 0's layer 1 is at 1.
  outcome = Push(set, 0, Chunks(set, 1, 1, 0, 0));
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_TRUE(outcome.response.applied());
  EXPECT_EQ(outcome.response.layer_version(), 1u);

  // A gather of layer 1 now would mix versions; it waits for the newer one
  // and times out rather than mixing them.
  client::GatherOptions options;
  options.timeout = std::chrono::milliseconds(1500);
  options.min_version = 1;
  absl::StatusOr<client::Layer> mixed = set.Gather(1, options);
  EXPECT_FALSE(mixed.ok());

  // Shard 1 catches up; the layer is whole again at version 1.
  for (uint32_t worker : {1u, 0u}) {
    outcome = Push(set, 1, Chunks(set, 1, worker, 0, 1));
    ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  }
  EXPECT_TRUE(outcome.response.applied());
  EXPECT_EQ(LayerVersion(set, 1), 1u);
  EXPECT_EQ(LayerVersion(set, 0), 0u);
  // An old step's push is one that counted already.
  EXPECT_EQ(Push(set, 0, good).status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
}

// A worker that dies mid-push leaves nothing behind; its push again counts
// once. Unfinished streams waiting for budget give it back when cancelled.
// The manifest names the set's workers and optimizer: a sink that could
// only be refused is refused at Create, before any gradient is computed.
TEST_F(TrainingTest, AGradientSinkChecksTheManifestBeforeAnyPush) {
  ASSERT_NO_FATAL_FAILURE(Start(1, 2));
  absl::StatusOr<std::unique_ptr<client::GradientSink>> sink =
      client::GradientSink::Create(*shards_.set, {.worker = 2});
  EXPECT_EQ(sink.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(sink.status().message(), HasSubstr("worker 2 is not in the shards' set of 2"));
  EXPECT_TRUE(client::GradientSink::Create(*shards_.set, {.worker = 1}).ok());
  ASSERT_EQ(shards_.processes->Stop(), absl::OkStatus());
  RunningShards read_only = StartShards(1, {"--model", model_.path, "--policy", kPolicy});
  ASSERT_NE(read_only.set, nullptr);
  sink = client::GradientSink::Create(*read_only.set, {.worker = 0});
  EXPECT_EQ(sink.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(sink.status().message(), HasSubstr("read-only"));
}

TEST_F(TrainingTest, AnInterruptedPushLeavesNothingAndAFloodGivesItsBudgetBack) {
  // A budget with room for one step of the largest layer: if the flood
  // below kept what it waited for, the real pushes after it could not be
  // staged.
  ASSERT_NO_FATAL_FAILURE(StartWithRoomForOneStep(2));
  const client::ShardSet& set = *shards_.set;
  const std::vector<layercast::v1::GradientChunk> good = Chunks(set, 1, 0, 0, 0);

  // A flood of streams that send their first chunk and stop.
  constexpr int kFlood = 24;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<layercast::v1::PushGradientsResponse> responses(kFlood);
  std::vector<std::unique_ptr<grpc::ClientWriter<layercast::v1::GradientChunk>>> writers;
  for (int i = 0; i < kFlood; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    writers.push_back(set.stub(0).PushGradients(contexts.back().get(), &responses[i]));
    writers.back()->Write(good[0]);
  }
  for (auto& context : contexts) context->TryCancel();
  for (auto& writer : writers) {
    // ABORTED: refused while the first of them was in flight.
    EXPECT_THAT(writer->Finish().error_code(),
                ::testing::AnyOf(grpc::StatusCode::CANCELLED, grpc::StatusCode::ABORTED));
  }

  // Worker 0's push then counts, and worker 1's applies the step.
  PushOutcome outcome = PushOnceAdmitted(set, 0, good);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_FALSE(outcome.response.applied());
  outcome = Push(set, 0, Chunks(set, 1, 1, 0, 0));
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_TRUE(outcome.response.applied());
  EXPECT_EQ(LayerVersion(set, 1), 1u);
}

// PushAdmissionTest's flood of PushGradients streams, driven on one
// completion queue so that no stream blocks the test. The shard admits
// whichever stream's first chunk a reactor reads first, and reactors run on
// several threads, so it is not always the first stream opened (under ASan,
// 7 floods in 30 admitted the second). A blocking Finish on the admitted
// stream waits out its deadline, and the refused streams' statuses not yet
// collected then read DEADLINE_EXCEEDED.
class PushFlood {
 public:
  enum Op : intptr_t { kStarted = 1, kWritten = 2, kFinished = 3 };
  struct Stream {
    grpc::ClientContext context;
    layercast::v1::PushGradientsResponse response;
    std::unique_ptr<grpc::ClientAsyncWriterInterface<layercast::v1::GradientChunk>> writer;
    grpc::Status status;  // once finished
    bool finished = false;
  };

  // Opens `n` streams; every operation on them ends by `deadline`.
  PushFlood(layercast::v1::ShardService::Stub& stub, size_t n,
            std::chrono::system_clock::time_point deadline)
      : streams_(n), give_up_(deadline + std::chrono::seconds(10)) {
    for (size_t i = 0; i < n; ++i) {
      Stream& stream = streams_[i];
      stream.context.set_deadline(deadline);
      stream.writer = stub.PrepareAsyncPushGradients(&stream.context, &stream.response, &cq_);
      stream.writer->StartCall(Tag(i, kStarted));
    }
  }

  // However the test ends, no operation outlives the queue.
  ~PushFlood() {
    for (Stream& stream : streams_) stream.context.TryCancel();
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  Stream& operator[](size_t i) { return streams_[i]; }
  size_t size() const { return streams_.size(); }

  void Write(size_t i, const layercast::v1::GradientChunk& chunk) {
    streams_[i].writer->Write(chunk, Tag(i, kWritten));
  }
  void WritesDone(size_t i) { streams_[i].writer->WritesDone(Tag(i, kWritten)); }
  void Finish(size_t i) { streams_[i].writer->Finish(&streams_[i].status, Tag(i, kFinished)); }

  // The queue's next event (a status marks its stream finished); false when
  // none came in time (the streams' deadline has passed well before then).
  bool Next(size_t* i, Op* op, bool* ok) {
    void* tag = nullptr;
    if (cq_.AsyncNext(&tag, ok, give_up_) != grpc::CompletionQueue::GOT_EVENT) return false;
    const auto bits = reinterpret_cast<intptr_t>(tag);
    *i = static_cast<size_t>(bits >> 2);
    *op = static_cast<Op>(bits & 3);
    if (*op == kFinished) streams_[*i].finished = true;
    return true;
  }

  // Waits for stream i's `op` (a write or its status): whether it succeeded.
  bool Await(size_t i, Op op) {
    size_t stream = 0;
    Op got = kStarted;
    bool ok = false;
    while (Next(&stream, &got, &ok)) {
      if (stream == i && got == op) return ok;
      // Its status came first: the write it waits for cannot succeed.
      if (stream == i && got == kFinished) return false;
    }
    return false;
  }

 private:
  static void* Tag(size_t i, Op op) {
    return reinterpret_cast<void*>(static_cast<intptr_t>(i) << 2 | op);
  }

  grpc::CompletionQueue cq_;
  std::vector<Stream> streams_;
  const std::chrono::system_clock::time_point give_up_;
};

// Streams of one push that send a chunk and go idle: one is admitted and
// staged inside its step's reservation, every other is refused at its
// first chunk, so the shard's memory stays within its budget (each used to
// stage its own copy of the layer slice, uncharged: 60 of them took a 100
// MiB shard past 1 GiB). The stream limit refuses the rest before they are
// read.
TEST(PushAdmissionTest, IdleStreamsOfOnePushStayWithinTheBudget) {
  // Two blocks of 3.4M parameters: 13 MiB of fp32 per layer slice.
  constexpr uint64_t kBudget = 96ull << 20;
  RunningShards shards =
      StartShards(1, {"--synthetic", "llama:layers=2,hidden=512,ffn=1536,vocab=64,seed=5",
                      "--policy", kPolicy, "--optimizer", kOptimizer, "--data-parallel-workers",
                      "2", "--chunk-bytes", std::to_string(kChunkBytes), "--delta-versions", "0",
                      "--memory-budget", std::to_string(kBudget), "--max-push-streams", "64"});
  ASSERT_NE(shards.set, nullptr);
  const client::ShardSet& set = *shards.set;
  uint32_t layer = 0;
  for (uint32_t l = 0; l < set.model().layers.size(); ++l) {
    if (set.view().gradient_layouts[l].total_bytes() >
        set.view().gradient_layouts[layer].total_bytes()) {
      layer = l;
    }
  }
  const std::vector<layercast::v1::GradientChunk> good = Chunks(set, layer, 0, 0, 0);
  constexpr size_t kFlood = 60;
  PushFlood flood(set.stub(0), kFlood + 8,
                  std::chrono::system_clock::now() + std::chrono::seconds(5));
  // The 60 that send a chunk: one admitted (it waits, idle, for the rest of
  // its push), 59 refused. The 8 beyond them: refused unread where 64
  // streams were open when they came (how many depends on how fast the
  // refused pushes closed), else empty pushes. Every stream but the admitted
  // one has its status once the shard has read each first chunk; the
  // admitted one has none until its push ends.
  size_t finished = 0;
  // Starts and writes on the queue: the admitted stream's next write may
  // only follow its first.
  size_t busy = flood.size();
  while (finished + 1 < flood.size() || busy > 0) {
    size_t i = 0;
    PushFlood::Op op = PushFlood::kStarted;
    bool ok = false;
    if (!flood.Next(&i, &op, &ok)) {
      ADD_FAILURE() << finished << " streams finished and " << busy << " busy at the give-up time";
      break;
    }
    if (op == PushFlood::kFinished) {
      ++finished;
      continue;
    }
    --busy;
    if (op == PushFlood::kStarted) {
      if (ok) {
        ++busy;
        if (i < kFlood) {
          flood.Write(i, good[0]);
        } else {
          flood.WritesDone(i);
        }
      }
      flood.Finish(i);
    }
  }
  int aborted = 0, over_limit = 0;
  std::vector<size_t> open;
  for (size_t i = 0; i < flood.size(); ++i) {
    if (!flood[i].finished) {
      open.push_back(i);
      continue;
    }
    const grpc::Status& status = flood[i].status;
    if (status.error_code() == grpc::StatusCode::ABORTED) {
      EXPECT_THAT(status.error_message(), HasSubstr("already in flight"));
      ++aborted;
    } else if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      EXPECT_THAT(status.error_message(), HasSubstr("--max-push-streams"));
      ++over_limit;
    } else if (i < kFlood) {
      ADD_FAILURE() << "stream " << i << ": " << status.error_code() << " "
                    << status.error_message();
    }
  }
  EXPECT_GE(aborted + over_limit, static_cast<int>(kFlood) - 1) << aborted << " + " << over_limit;
  ASSERT_EQ(open.size(), 1u) << "streams still open: " << ::testing::PrintToString(open);
  const size_t admitted = open[0];
  ASSERT_LT(admitted, kFlood);
  if (!kSanitized) {
    const uint64_t peak = shards.processes->PeakRssBytes(0);
    std::printf("peak RSS %s with a budget of %s\n", FormatBytes(peak).c_str(),
                FormatBytes(kBudget).c_str());
    // The budget, and the process and gRPC overhead memory_test allows.
    EXPECT_LE(peak, kBudget + (32ull << 20));
  }
  // The admitted stream finishes the push; worker 1's applies the step.
  for (size_t c = 1; c < good.size(); ++c) {
    flood.Write(admitted, good[c]);
    ASSERT_TRUE(flood.Await(admitted, PushFlood::kWritten))
        << "stream " << admitted << ", chunk " << c << ": " << flood[admitted].status.error_code()
        << " " << flood[admitted].status.error_message();
  }
  flood.WritesDone(admitted);
  ASSERT_TRUE(flood.Await(admitted, PushFlood::kWritten));
  if (!flood[admitted].finished) flood.Await(admitted, PushFlood::kFinished);
  ASSERT_TRUE(flood[admitted].finished) << "stream " << admitted << " has no status";
  const grpc::Status& first = flood[admitted].status;
  ASSERT_TRUE(first.ok()) << "stream " << admitted << ": " << first.error_code() << " "
                          << first.error_message();
  const PushOutcome outcome = Push(set, 0, Chunks(set, layer, 1, 0, 0));
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_TRUE(outcome.response.applied());
}

// A worker that runs a whole backward pass ahead of the other cannot starve
// it: the push that opens a layer step reserves the staging of every
// worker's, so with room for one step of the largest layer, worker 0's
// pushes of later layers wait for budget while worker 1's complete the
// steps already open.
TEST_F(TrainingTest, AWorkerRunningAheadCannotStarveTheOthersOfBudget) {
  ASSERT_NO_FATAL_FAILURE(StartWithRoomForOneStep(2));
  const client::ShardSet& set = *shards_.set;
  const auto layers = static_cast<uint32_t>(set.model().layers.size());
  std::vector<std::unique_ptr<client::GradientSink>> sinks;
  for (uint32_t w = 0; w < 2; ++w) {
    auto sink = client::GradientSink::Create(
        set, {.worker = w, .chunk_bytes = kChunkBytes, .timeout = std::chrono::seconds(20)});
    ASSERT_TRUE(sink.ok()) << sink.status();
    sinks.push_back(*std::move(sink));
  }
  for (uint32_t w = 0; w < 2; ++w) {  // worker 0's whole backward pass, then worker 1's
    for (uint32_t l = layers; l-- > 0;) {
      auto gradient = client::LayerBuffer::Allocate(set.view().gradient_layouts[l].total_bytes());
      ASSERT_TRUE(gradient.ok());
      ASSERT_TRUE(tools::FillSyntheticGradient(set.view().gradient_layouts[l], w, 0, l,
                                               {gradient->data(), gradient->size()})
                      .ok());
      ASSERT_TRUE(sinks[w]->Push(l, 0, *std::move(gradient)).ok());
    }
  }
  for (auto& sink : sinks) {
    const absl::Status flushed = sink->Flush();
    EXPECT_TRUE(flushed.ok()) << flushed;
  }
  for (uint32_t l = 0; l < layers; ++l) EXPECT_EQ(LayerVersion(set, l), 1u) << "layer " << l;
}

// A worker that opens a push and stops sending is cut off after
// --write-progress-timeout-ms; nothing of it is staged, and the step it
// opened (and reserved budget for) completes with the real pushes.
TEST_F(TrainingTest, APushThatStopsSendingIsCutOffAndLeavesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartWithRoomForOneStep(2, {"--write-progress-timeout-ms", "300"}));
  const client::ShardSet& set = *shards_.set;
  const uint32_t layer = largest_layer_;  // one step of it fills the budget
  const std::vector<layercast::v1::GradientChunk> good = Chunks(set, layer, 0, 0, 0);
  for (int round = 0; round < 3; ++round) {  // more stalled pushes than the budget holds
    grpc::Status status;
    // ABORTED while the shard still cleans up the last round's stream.
    for (int attempt = 0; attempt < 100; ++attempt) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      layercast::v1::PushGradientsResponse response;
      auto writer = set.stub(0).PushGradients(&context, &response);
      ASSERT_TRUE(writer->Write(good[0]));
      status = writer->Finish();  // no WritesDone: the worker hangs
      if (status.error_code() != grpc::StatusCode::ABORTED) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_THAT(status.error_message(), HasSubstr("sent no chunk within"));
  }
  PushOutcome outcome = PushOnceAdmitted(set, 0, good);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  outcome = Push(set, 0, Chunks(set, layer, 1, 0, 0));
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  EXPECT_TRUE(outcome.response.applied());
}

// With --worker-token-dir a push or a clip scale for worker k needs worker
// k's token: another peer, or another worker, can neither poison worker k's
// share of the mean nor take its place (the real worker k used to get
// ALREADY_EXISTS), and the real worker's push counts.
TEST_F(TrainingTest, WorkerTokensKeepEachWorkersPushItsOwn) {
  const std::string dir = MakeTempDir("worker-tokens");
  const std::vector<std::string> tokens = {"worker-zero-token-0123456789abcdef",
                                           "worker-one-token-0123456789abcdef"};
  for (size_t k = 0; k < tokens.size(); ++k) {
    const std::string path = absl::StrCat(dir, "/worker-", k);
    std::ofstream(path) << tokens[k] << "\n";
    std::filesystem::permissions(
        path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
  ASSERT_NO_FATAL_FAILURE(Start(1, 2, {"--worker-token-dir", dir}));
  const client::ShardSet& set = *shards_.set;
  const std::vector<layercast::v1::GradientChunk> good = Chunks(set, 1, 0, 0, 0);
  PushOutcome outcome = Push(set, 0, good);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("needs a worker's token"));
  outcome = Push(set, 0, good, tokens[1]);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("a push for worker 0"));
  {
    grpc::ClientContext context;
    layercast::v1::ApplyClippedStepRequest request;
    request.set_scale(1.0f);
    layercast::v1::ApplyClippedStepResponse response;
    EXPECT_EQ(set.stub(0).ApplyClippedStep(&context, request, &response).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // The worker library sends its token, over plaintext only when told to.
  EXPECT_EQ(
      client::GradientSink::Create(set, {.worker = 0, .worker_token = tokens[0]}).status().code(),
      absl::StatusCode::kInvalidArgument);
  for (uint32_t w = 0; w < 2; ++w) {
    auto sink = client::GradientSink::Create(set, {.worker = w,
                                                   .chunk_bytes = kChunkBytes,
                                                   .worker_token = tokens[w] + "\n",
                                                   .insecure = true});
    ASSERT_TRUE(sink.ok()) << sink.status();
    auto gradient = client::LayerBuffer::Allocate(set.view().gradient_layouts[1].total_bytes());
    ASSERT_TRUE(gradient.ok());
    ASSERT_TRUE(tools::FillSyntheticGradient(set.view().gradient_layouts[1], w, 0, 1,
                                             {gradient->data(), gradient->size()})
                    .ok());
    ASSERT_TRUE((*sink)->Push(1, 0, *std::move(gradient)).ok());
    const absl::Status flushed = (*sink)->Flush();
    ASSERT_TRUE(flushed.ok()) << flushed;
  }
  EXPECT_EQ(LayerVersion(set, 1), 1u);
}

// With --worker-token-dir a push stream shows a worker's token before it
// takes a slot: strangers' idle streams, as many as --max-push-streams,
// are refused at once and leave every slot to the worker, whose pushes all
// count (they used to hold every slot until their first chunk, and the
// worker's pushes were refused RESOURCE_EXHAUSTED). One connection holds at
// most --max-push-streams-per-connection.
TEST_F(TrainingTest, StrangersWithoutATokenTakeNoPushSlot) {
  constexpr int kMaxPushStreams = 128;
  constexpr int kConnections = 4;
  const std::string dir = MakeTempDir("stranger-streams");
  const std::string token = "worker-zero-token-0123456789abcdef";
  {
    const std::string path = dir + "/worker-0";
    std::ofstream(path) << token << "\n";
    std::filesystem::permissions(
        path, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
  ASSERT_NO_FATAL_FAILURE(Start(
      1, 1, {"--worker-token-dir", dir, "--max-push-streams", std::to_string(kMaxPushStreams)}));
  const client::ShardSet& set = *shards_.set;

  // Strangers on connections of their own (a channel each, not shared),
  // holding their streams open and sending nothing; one shows a made-up
  // token.
  std::vector<std::unique_ptr<layercast::v1::ShardService::Stub>> stubs;
  for (int c = 0; c < kConnections; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stubs.push_back(layercast::v1::ShardService::NewStub(
        grpc::CreateCustomChannel(set.addresses()[0], grpc::InsecureChannelCredentials(), args)));
  }
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<layercast::v1::PushGradientsResponse> responses(kMaxPushStreams);
  std::vector<std::unique_ptr<grpc::ClientWriter<layercast::v1::GradientChunk>>> writers;
  for (int i = 0; i < kMaxPushStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(15));
    if (i == 0) contexts.back()->AddMetadata("authorization", "Bearer not-a-workers-token-0123");
    writers.push_back(stubs[i % kConnections]->PushGradients(contexts.back().get(), &responses[i]));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // every stream reaches the shard

  // The worker pushes every layer of ten steps, each once, with no retry.
  const auto layers = static_cast<uint32_t>(set.model().layers.size());
  int pushed = 0;
  for (uint64_t step = 0; pushed < 10; ++step) {
    for (uint32_t l = 0; l < layers && pushed < 10; ++l, ++pushed) {
      const PushOutcome outcome = Push(set, 0, Chunks(set, l, 0, step, 0), token);
      EXPECT_TRUE(outcome.status.ok()) << "push " << pushed << ": " << outcome.status.error_code()
                                       << " " << outcome.status.error_message();
    }
  }
  // Refused already: Finish reads the status (on the old code it waited
  // for the deadline).
  for (int i = 0; i < kMaxPushStreams; ++i) {
    const grpc::Status status = writers[i]->Finish();
    EXPECT_EQ(status.error_code(),
              i == 0 ? grpc::StatusCode::PERMISSION_DENIED : grpc::StatusCode::UNAUTHENTICATED)
        << "stranger " << i << ": " << status.error_message();
    if (i < 2) {
      EXPECT_THAT(status.error_message(),
                  HasSubstr(i == 0 ? "no worker's" : "needs a worker's token"));
    }
  }

  // The worker's own idle streams on one connection: one past
  // --max-push-streams-per-connection (default 32) is refused.
  constexpr int kPerConnection = 32;
  std::vector<std::unique_ptr<grpc::ClientContext>> own;
  std::vector<layercast::v1::PushGradientsResponse> own_responses(kPerConnection + 1);
  std::vector<std::unique_ptr<grpc::ClientWriter<layercast::v1::GradientChunk>>> own_writers;
  for (int i = 0; i <= kPerConnection; ++i) {
    // Streams reach the shard in no set order: the last one after the rest.
    if (i == kPerConnection) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    own.push_back(std::make_unique<grpc::ClientContext>());
    own.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    own.back()->AddMetadata("authorization", "Bearer " + token);
    own_writers.push_back(set.stub(0).PushGradients(own.back().get(), &own_responses[i]));
  }
  const grpc::Status over = own_writers[kPerConnection]->Finish();
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << over.error_message();
  EXPECT_THAT(over.error_message(), HasSubstr("--max-push-streams-per-connection"));
  for (int i = 0; i < kPerConnection; ++i) own[i]->TryCancel();
  for (int i = 0; i < kPerConnection; ++i) (void)own_writers[i]->Finish();
}

// A worker that dies mid-step and is restarted with its index pushes the
// step again: the layers it pushed before count once (they used to come
// back ALREADY_EXISTS, failing the restarted worker while the other waited
// for ever), the rest complete the step.
TEST_F(TrainingTest, ARestartedWorkerRejoinsTheStepItDiedIn) {
  ASSERT_NO_FATAL_FAILURE(Start(2, 2));
  const client::ShardSet& set = *shards_.set;
  const auto layers = static_cast<uint32_t>(set.model().layers.size());
  const auto push_all = [&](client::GradientSink& sink, uint32_t worker, uint32_t count) {
    for (uint32_t l = layers; l-- > layers - count;) {
      auto gradient = client::LayerBuffer::Allocate(set.view().gradient_layouts[l].total_bytes());
      ASSERT_TRUE(gradient.ok());
      ASSERT_TRUE(tools::FillSyntheticGradient(set.view().gradient_layouts[l], worker, 0, l,
                                               {gradient->data(), gradient->size()})
                      .ok());
      ASSERT_TRUE(sink.Push(l, 0, *std::move(gradient)).ok());
    }
    const absl::Status flushed = sink.Flush();
    ASSERT_TRUE(flushed.ok()) << flushed;
  };
  {
    // Worker 0 pushes the last two layers of its backward pass, then dies.
    auto dying = client::GradientSink::Create(set, {.worker = 0, .chunk_bytes = kChunkBytes});
    ASSERT_TRUE(dying.ok()) << dying.status();
    ASSERT_NO_FATAL_FAILURE(push_all(**dying, 0, 2));
  }
  auto restarted = client::GradientSink::Create(set, {.worker = 0, .chunk_bytes = kChunkBytes});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  ASSERT_NO_FATAL_FAILURE(push_all(**restarted, 0, layers));
  auto other = client::GradientSink::Create(set, {.worker = 1, .chunk_bytes = kChunkBytes});
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_NO_FATAL_FAILURE(push_all(**other, 1, layers));
  for (uint32_t l = 0; l < layers; ++l) EXPECT_EQ(LayerVersion(set, l), 1u) << "layer " << l;
}

// The worker library's sink: W workers' pushes advance every layer once per
// step, and a gather at min_version = step + 1 waits for the update.
TEST_F(TrainingTest, GradientSinksOfTwoWorkersAdvanceEveryLayerOncePerStep) {
  ASSERT_NO_FATAL_FAILURE(Start(3, 2));
  const client::ShardSet& set = *shards_.set;
  const auto layers = static_cast<uint32_t>(set.model().layers.size());
  std::vector<std::unique_ptr<client::GradientSink>> sinks;
  for (uint32_t w = 0; w < 2; ++w) {
    auto sink = client::GradientSink::Create(set, {.worker = w, .chunk_bytes = kChunkBytes});
    ASSERT_TRUE(sink.ok()) << sink.status();
    sinks.push_back(*std::move(sink));
  }
  for (uint64_t step = 0; step < 3; ++step) {
    std::vector<std::shared_future<absl::StatusOr<client::PushResult>>> results;
    for (uint32_t l = layers; l-- > 0;) {
      for (uint32_t w = 0; w < 2; ++w) {
        client::GatherOptions options;
        options.min_version = step;
        absl::StatusOr<client::Layer> layer = set.Gather(l, options);
        ASSERT_TRUE(layer.ok()) << layer.status();
        ASSERT_EQ(layer->version(), step);
        auto gradient = client::LayerBuffer::Allocate(set.view().gradient_layouts[l].total_bytes());
        ASSERT_TRUE(gradient.ok());
        ASSERT_TRUE(tools::FillSyntheticGradient(set.view().gradient_layouts[l], w, step, l,
                                                 {gradient->data(), gradient->size()})
                        .ok());
        auto pushed = sinks[w]->Push(l, step, *std::move(gradient));
        ASSERT_TRUE(pushed.ok()) << pushed.status();
        results.push_back(*pushed);
      }
    }
    for (auto& sink : sinks) ASSERT_TRUE(sink->Flush().ok());
    uint32_t applied = 0;
    for (auto& result : results) {
      ASSERT_TRUE(result.get().ok()) << result.get().status();
      applied += result.get()->shards_applied;
    }
    // On each shard, one of the two pushes of each layer completes its step.
    EXPECT_EQ(applied, layers * set.addresses().size());
    for (uint32_t l = 0; l < layers; ++l) EXPECT_EQ(LayerVersion(set, l), step + 1);
  }
  // A push of a step the layer is past counted once already: the sink
  // reports it so (a restarted worker pushing again rejoins), and nothing
  // is applied again.
  auto gradient = client::LayerBuffer::Allocate(set.view().gradient_layouts[0].total_bytes());
  ASSERT_TRUE(gradient.ok());
  auto pushed = sinks[0]->Push(0, 1, *std::move(gradient));
  ASSERT_TRUE(pushed.ok());
  ASSERT_TRUE(pushed->get().ok()) << pushed->get().status();
  EXPECT_FALSE(pushed->get()->applied);
  EXPECT_EQ(pushed->get()->shards_applied, 0u);
  EXPECT_EQ(LayerVersion(set, 0), 3u) << "not applied again";
}

// An optimizer step keeps the version it supersedes for pinned readers: a
// worker walking the model at version 0 still gets 0 for a layer already
// stepped to 1, bit for bit what it was. (Its first pinned read is what
// starts the shards recording their steps.)
TEST_F(TrainingTest, APinnedReadGetsALayerAtTheVersionAStepSuperseded) {
  ASSERT_NO_FATAL_FAILURE(Start(2, 1));
  const client::ShardSet& set = *shards_.set;
  client::GatherOptions pinned;
  pinned.exact_version = 0;
  absl::StatusOr<client::Layer> before = set.Gather(0, pinned);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(before->version(), 0u);
  auto sink = client::GradientSink::Create(set, {.worker = 0, .chunk_bytes = kChunkBytes});
  ASSERT_TRUE(sink.ok()) << sink.status();
  auto gradient = client::LayerBuffer::Allocate(set.view().gradient_layouts[0].total_bytes());
  ASSERT_TRUE(gradient.ok());
  ASSERT_TRUE(tools::FillSyntheticGradient(set.view().gradient_layouts[0], 0, 0, 0,
                                           {gradient->data(), gradient->size()})
                  .ok());
  auto pushed = (*sink)->Push(0, 0, *std::move(gradient));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  ASSERT_TRUE(pushed->get().ok()) << pushed->get().status();
  ASSERT_EQ(LayerVersion(set, 0), 1u);

  absl::StatusOr<client::Layer> at_zero = set.Gather(0, pinned);
  ASSERT_TRUE(at_zero.ok()) << at_zero.status();
  EXPECT_EQ(at_zero->version(), 0u);
  absl::StatusOr<client::Layer> now = set.Gather(0);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->version(), 1u);
  bool moved = false;
  for (size_t t = 0; t < before->num_tensors(); ++t) {
    const std::span<const uint8_t> old_bytes = before->tensor(t).bytes;
    EXPECT_EQ(std::memcmp(at_zero->tensor(t).bytes.data(), old_bytes.data(), old_bytes.size()), 0)
        << before->tensor(t).name;
    moved |= std::memcmp(now->tensor(t).bytes.data(), old_bytes.data(), old_bytes.size()) != 0;
  }
  EXPECT_TRUE(moved) << "the step changed nothing, so the test shows nothing";
}

// A training shard's checkpoint carries its optimizer state under the same
// checksum as its master: a flipped bit in the state stops the restart; and
// a read-only shard's checkpoint past version 0 has no state to train on.
TEST_F(TrainingTest, CheckpointedOptimizerStateIsCheckedAndRequired) {
  const std::string checkpoints = MakeTempDir("training-state");
  ASSERT_NO_FATAL_FAILURE(Start(1, 1, {"--checkpoint-dir", checkpoints}, kMomentum));
  for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
    ASSERT_TRUE(Push(*shards_.set, 0, Chunks(*shards_.set, l, 0, 0, 0)).status.ok());
  }
  ASSERT_EQ(shards_.processes->Stop(), absl::OkStatus());  // SIGTERM: writes the checkpoint
  const std::string file = checkpoints + "/shard-0-of-1.safetensors";
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_NE(bytes.find("__optimizer__/momentum_buffer/"), std::string::npos);
  ASSERT_NE(bytes.find("\"layer_versions\":\"1,1,1,1\""), std::string::npos)
      << bytes.substr(0, 600);
  const std::string start = absl::StrCat(ShardBinary(), " --model ", model_.path, " --policy '",
                                         kPolicy, "' --checkpoint-dir ", checkpoints,
                                         " --listen 127.0.0.1:0 --num-shards 1 --shard-index 0 ");
  bytes[bytes.size() - 3] ^= 0x10;  // the last state tensor's data
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  std::string output;
  EXPECT_NE(RunCommand(start + "--optimizer " + kMomentum, &output), 0);
  EXPECT_THAT(output, HasSubstr("is corrupt"));

  // Restored, it resumes only with an optimizer that keeps the same state.
  bytes[bytes.size() - 3] ^= 0x10;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_NE(RunCommand(start + "--optimizer adamw:lr=1", &output), 0);
  EXPECT_THAT(output, HasSubstr("whose state for tensor"));
  EXPECT_NE(RunCommand(start + "--optimizer sgd:lr=1", &output), 0);
  EXPECT_THAT(output, HasSubstr("whose state for tensor"));
}

TEST_F(TrainingTest, TheStartUpCheckCountsOptimizerStateAndStaging) {
  const TestModel model =
      WriteTestModel(MakeTempDir("training-budget") + "/model.safetensors", 2, 5);
  uint64_t master = 0;
  for (const auto& [name, values] : model.values) master += 4 * values.size();
  std::string output;
  // Room for the master and a stream, not for AdamW's state beside it.
  const int status = RunCommand(
      absl::StrCat(ShardBinary(), " --model ", model.path,
                   " --optimizer adamw:lr=1e-3 --data-parallel-workers 4 --memory-budget ",
                   2 * master, " --num-shards 1 --shard-index 0 --listen 127.0.0.1:0"),
      &output);
  EXPECT_NE(status, 0);
  EXPECT_THAT(output, HasSubstr("cannot train in --memory-budget"));
  EXPECT_THAT(output, HasSubstr("of adamw state"));
  EXPECT_THAT(output, HasSubstr("4 workers' pushes in fp32"));
}

}  // namespace
}  // namespace layercast::testing
