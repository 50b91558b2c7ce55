// A relay under the attacks a shard withstands: readers that open a layer
// and never read, a flood of long polls from one connection, versions that
// cannot come. A relay runs the shard's serving core, so it answers each
// as a shard does: within its memory budget, its threads flat, its slots
// bounded, and OUT_OF_RANGE for a version too far ahead.

#include <algorithm>
#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>

#include "layercast/v1/shard.grpc.pb.h"
#include "tests/integration/relay_process.h"
#include "tests/integration/shard_fixture.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

// A field of /proc/`pid`/status ("VmRSS", kB; "Threads"); 0 if unreadable.
uint64_t ProcStatus(pid_t pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1));
  }
  return 0;
}

std::unique_ptr<layercast::v1::ShardService::Stub> Stub(const std::string& address) {
  return layercast::v1::ShardService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

class RelayLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("relay_limits");
    // 3.4M parameters a block: 3.3 MiB of bfloat16 per layer slice.
    shards_ = StartShards(2, {"--synthetic", "llama:layers=2,hidden=512,ffn=1536,vocab=64,seed=5",
                              "--policy", "p=f32,c=bf16"});
    ASSERT_NE(shards_.set, nullptr);
  }

  // A relay of the shards with `flags`, once it holds every layer.
  std::unique_ptr<RelayProcess> StartRelay(const std::vector<std::string>& flags) {
    std::vector<std::string> all = {"--metrics-listen", "127.0.0.1:0"};
    all.insert(all.end(), flags.begin(), flags.end());
    auto relay = std::make_unique<RelayProcess>(dir_, "relay", shards_.set->addresses(), "", all);
    if (relay->addresses().size() != 2) {
      ADD_FAILURE() << "the relay did not start; see " << relay->log();
      return nullptr;
    }
    // Every layer landed: a read of the last one at version 0 answers.
    auto stub = Stub(relay->addresses()[0]);
    layercast::v1::FetchLayerRequest request;
    request.set_layer(static_cast<uint32_t>(shards_.set->model().layers.size() - 1));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = stub->FetchLayer(&context, request);
    for (layercast::v1::LayerChunk chunk; reader->Read(&chunk);) {
    }
    const grpc::Status read = reader->Finish();
    EXPECT_TRUE(read.ok()) << read.error_message();
    return relay;
  }

  // The layer with the most bytes.
  uint32_t LargestLayer() const {
    uint32_t largest = 0;
    for (uint32_t l = 0; l < shards_.set->view().layouts.size(); ++l) {
      if (shards_.set->view().layouts[l].total_bytes() >
          shards_.set->view().layouts[largest].total_bytes()) {
        largest = l;
      }
    }
    return largest;
  }

  std::string dir_;
  RunningShards shards_;
};

// 16 readers open the largest layer and never read. Each used to grow a
// relay by more than the layer (a copy per stream, 35 MiB each for a
// 32 MiB layer) and hold a thread, still open 35 s later. Now they send
// slices of the one version held, within the relay's budget, and the stall
// sweep cuts every one after --write-progress-timeout-ms.
TEST_F(RelayLimitsTest, UnreadStreamsStayWithinTheBudgetAndAreCutAfterTheStallTimeout) {
  constexpr uint64_t kBudget = 64ull << 20;
  std::unique_ptr<RelayProcess> relay = StartRelay(
      {"--memory-budget", std::to_string(kBudget), "--write-progress-timeout-ms", "400"});
  ASSERT_NE(relay, nullptr);
  const uint64_t rss_before = ProcStatus(relay->pid(), "VmRSS") << 10;
  const uint64_t threads_before = ProcStatus(relay->pid(), "Threads");
  ASSERT_GT(rss_before, 0u);

  constexpr int kStreams = 16;
  // As an attacker's client would: no window grown past gRPC's first 64
  // KiB (no bandwidth probe), so no stream's slice fits in the windows.
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  auto stub = layercast::v1::ShardService::NewStub(grpc::CreateCustomChannel(
      relay->addresses()[0], grpc::InsecureChannelCredentials(), arguments));
  layercast::v1::FetchLayerRequest request;
  request.set_layer(LargestLayer());
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<layercast::v1::LayerChunk>>> readers;
  for (int i = 0; i < kStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    readers.push_back(stub->FetchLayer(contexts.back().get(), request));
  }
  // Watched while the sweep cuts them: resident memory and threads.
  uint64_t rss_peak = rss_before, threads_peak = threads_before;
  bool cut = false;
  for (int look = 0; look < 3000 && !cut; ++look) {
    rss_peak = std::max(rss_peak, ProcStatus(relay->pid(), "VmRSS") << 10);
    threads_peak = std::max(threads_peak, ProcStatus(relay->pid(), "Threads"));
    cut = ShardMetric(relay->log(), "layercast_streams_stalled_total").value_or(0) >= kStreams;
    if (!cut) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(cut) << "the relay cut "
                   << ShardMetric(relay->log(), "layercast_streams_stalled_total").value_or(-1)
                   << " of " << kStreams << " unread streams";
  for (auto& reader : readers) {
    // What reached the reader before the cut, then the status.
    for (layercast::v1::LayerChunk chunk; reader->Read(&chunk);) {
    }
    const grpc::Status status = reader->Finish();
    EXPECT_FALSE(status.ok()) << "an unread stream was not cut";
  }
  std::printf(
      "relay RSS %.1f MiB before, %.1f MiB at most with %d unread streams; threads %lu "
      "then %lu\n",
      rss_before / 1048576.0, rss_peak / 1048576.0, kStreams, threads_before, threads_peak);
  // One chunk or two in flight per stream, sliced from the held version:
  // no copy of the layer per stream (3.3 MiB each here).
  EXPECT_LE(rss_peak, rss_before + (16ull << 20));
  EXPECT_LE(ShardMetric(relay->log(), "layercast_memory_in_use_bytes").value_or(kBudget + 1),
            kBudget);
  EXPECT_LE(threads_peak, threads_before + 4) << "a thread per stream?";
}

// 4000 long polls from one connection: a relay parks
// --max-waits-per-connection of them and refuses the rest at once, its
// threads flat (it used to park all 4000 on 4000 threads); a min_version
// far ahead is OUT_OF_RANGE, as a shard answers it, for a poll and a read.
TEST_F(RelayLimitsTest, LongPollsParkNoMoreThanAShardWouldAndAbsurdVersionsAreOutOfRange) {
  std::unique_ptr<RelayProcess> relay = StartRelay({"--max-waits-per-connection", "8"});
  ASSERT_NE(relay, nullptr);
  auto stub = Stub(relay->addresses()[0]);
  const uint64_t threads_before = ProcStatus(relay->pid(), "Threads");

  constexpr int kPolls = 4000;
  grpc::CompletionQueue queue;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(kPolls);
  std::vector<layercast::v1::WaitVersionResponse> responses(kPolls);
  std::vector<grpc::Status> statuses(kPolls);
  layercast::v1::WaitVersionRequest poll;
  poll.set_min_version(1);  // the set is at 0: every poll waits
  for (int i = 0; i < kPolls; ++i) {
    contexts[i] = std::make_unique<grpc::ClientContext>();
    contexts[i]->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    stub->AsyncWaitVersion(contexts[i].get(), poll, &queue)
        ->Finish(&responses[i], &statuses[i], reinterpret_cast<void*>(static_cast<intptr_t>(i)));
  }
  int refused = 0, other = 0;
  uint64_t threads_peak = threads_before;
  const auto give_up = std::chrono::system_clock::now() + std::chrono::seconds(60);
  for (int answered = 0; answered < kPolls - 8;) {
    void* tag = nullptr;
    bool ok = false;
    if (queue.AsyncNext(&tag, &ok, give_up) != grpc::CompletionQueue::GOT_EVENT) break;
    ++answered;
    const grpc::Status& status = statuses[reinterpret_cast<intptr_t>(tag)];
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
      if (refused == 1) {
        EXPECT_THAT(status.error_message(), HasSubstr("--max-waits-per-connection"));
      }
    } else {
      ++other;
    }
    if (answered % 500 == 0) {
      threads_peak = std::max(threads_peak, ProcStatus(relay->pid(), "Threads"));
    }
  }
  EXPECT_EQ(refused, kPolls - 8) << other << " polls ended otherwise";
  EXPECT_LE(threads_peak, threads_before + 4) << "a thread per poll?";
  std::printf("relay threads %lu before, %lu at most under %d polls\n", threads_before,
              threads_peak, kPolls);
  // The 8 parked ones are still waiting; cancelled, they end.
  for (auto& context : contexts) context->TryCancel();
  for (int left = 8; left > 0; --left) {
    void* tag = nullptr;
    bool ok = false;
    ASSERT_EQ(queue.AsyncNext(&tag, &ok, give_up), grpc::CompletionQueue::GOT_EVENT);
    EXPECT_EQ(statuses[reinterpret_cast<intptr_t>(tag)].error_code(), grpc::StatusCode::CANCELLED);
  }
  queue.Shutdown();

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  poll.set_min_version(1000000000);
  layercast::v1::WaitVersionResponse response;
  grpc::Status status = stub->WaitVersion(&context, poll, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::OUT_OF_RANGE) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--max-version-lead"));

  layercast::v1::FetchLayerRequest read;
  read.set_min_version(1000000000);
  grpc::ClientContext read_context;
  read_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto reader = stub->FetchLayer(&read_context, read);
  for (layercast::v1::LayerChunk chunk; reader->Read(&chunk);) {
  }
  status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::OUT_OF_RANGE) << status.error_message();
}

}  // namespace
}  // namespace layercast::testing
