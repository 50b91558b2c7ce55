// LayerGather against a shard that misbehaves at the end of its stream: a
// gather is settled by what each stream delivered, not by how it ended.

#include "client/layer_gather.h"

#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "layercast/v1/shard.grpc.pb.h"

namespace layercast::client {
namespace {

constexpr uint64_t kElements = 1000;
constexpr uint64_t kChunkElements = 400;

// Sends the whole of tensor 0 (bfloat16 element i = i) in chunks, then ends
// with UNAVAILABLE instead of OK, as a shard whose connection drops just
// after its last chunk would. With `corrupt_first`, the first call's first
// chunk carries a CRC-32C that does not match its data.
class FailsAfterLastChunk final : public layercast::v1::ShardService::CallbackService {
 public:
  explicit FailsAfterLastChunk(bool corrupt_first = false) : corrupt_first_(corrupt_first) {}

  std::atomic<int> calls{0};
  std::atomic<int> recast_calls{0};

  grpc::ServerWriteReactor<layercast::v1::LayerChunk>* FetchLayer(
      grpc::CallbackServerContext*, const layercast::v1::FetchLayerRequest* request) override {
    const bool corrupt = corrupt_first_ && calls == 0;
    ++calls;
    if (request->recast()) ++recast_calls;
    return new Writer(corrupt);
  }

 private:
  const bool corrupt_first_;

  class Writer final : public grpc::ServerWriteReactor<layercast::v1::LayerChunk> {
   public:
    explicit Writer(bool corrupt) : corrupt_(corrupt) { WriteNext(); }
    void OnWriteDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
        return;
      }
      WriteNext();
    }
    void OnDone() override { delete this; }

   private:
    void WriteNext() {
      if (next_ == kElements) {
        Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection dropped"));
        return;
      }
      const uint64_t n = std::min(kChunkElements, kElements - next_);
      std::string data(n * 2, '\0');
      for (uint64_t i = 0; i < n; ++i) {
        data[2 * i] = static_cast<char>((next_ + i) & 0xff);
        data[2 * i + 1] = static_cast<char>((next_ + i) >> 8);
      }
      chunk_.Clear();
      chunk_.set_tensor(0);
      chunk_.set_element_offset(next_);
      chunk_.set_data(std::move(data));
      chunk_.set_version(3);
      if (corrupt_) chunk_.set_crc32c(0xbadc0de);
      corrupt_ = false;
      next_ += n;
      StartWrite(&chunk_);
    }
    bool corrupt_;
    uint64_t next_ = 0;
    layercast::v1::LayerChunk chunk_;
  };
};

// Runs a gather of the fake's one tensor; returns its result and checks the
// bytes when it succeeded.
absl::StatusOr<uint64_t> GatherFrom(FailsAfterLastChunk& service, int* retries) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  EXPECT_NE(server, nullptr);
  grpc::GenericStub stub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));

  const AssembledLayout layout = *AssembledLayout::FromDTypes({DType::kBFloat16}, {kElements});
  std::vector<uint8_t> buffer(layout.total_bytes());
  GatherOptions options;
  options.timeout = std::chrono::seconds(20);
  options.on_retry = [&](const absl::Status&, std::chrono::milliseconds) { ++*retries; };
  LayerGather gather({LayerGather::Shard{&stub, "shard 0 (fake)", ""}}, layout, 0, options, buffer,
                     0);
  absl::StatusOr<uint64_t> version = gather.Run();
  if (version.ok()) {
    for (uint64_t i = 0; i < kElements; ++i) {
      EXPECT_EQ(buffer[2 * i] | (buffer[2 * i + 1] << 8), static_cast<int>(i)) << "element " << i;
    }
  }
  server->Shutdown();
  return version;
}

TEST(LayerGatherTest, AStreamThatFailsAfterItsLastChunkCompletesTheGather) {
  FailsAfterLastChunk service;
  int retries = 0;
  absl::StatusOr<uint64_t> version = GatherFrom(service, &retries);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 3u);
  EXPECT_EQ(service.calls.load(), 1) << "nothing was left to ask for";
  EXPECT_EQ(retries, 0);
}

TEST(LayerGatherTest, AChunkThatFailsItsChecksumIsAskedForAfresh) {
  FailsAfterLastChunk service(/*corrupt_first=*/true);
  int retries = 0;
  absl::StatusOr<uint64_t> version = GatherFrom(service, &retries);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(service.calls.load(), 2);
  EXPECT_EQ(retries, 1);
  EXPECT_EQ(service.recast_calls.load(), 1) << "the retry asks the shard not to resend its copy";
}

}  // namespace
}  // namespace layercast::client
