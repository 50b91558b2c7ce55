#include "client/shard_stream.h"

#include "absl/strings/str_cat.h"
#include "wire/grpc_status.h"
#include "wire/incarnation.h"

namespace layercast::client {
namespace {

constexpr char kFetchLayerMethod[] = "/layercast.v1.ShardService/FetchLayer";

}  // namespace

ShardStream::ShardStream(std::string describe, std::vector<Run> runs, std::span<uint8_t> buffer,
                         std::function<void()> on_done,
                         std::function<void(uint64_t bytes)> on_chunk,
                         std::optional<uint64_t> base_version)
    : describe_(std::move(describe)),
      decoder_(std::move(runs), buffer, base_version),
      on_done_(std::move(on_done)),
      on_chunk_(std::move(on_chunk)) {}

void ShardStream::Start(grpc::GenericStub& stub, const layercast::v1::FetchLayerRequest& request,
                        std::chrono::system_clock::time_point deadline) {
  const std::string bytes = request.SerializeAsString();
  const grpc::Slice slice(bytes);
  request_ = grpc::ByteBuffer(&slice, 1);
  context_.set_deadline(deadline);
  // A server-streaming method called as a bidi stream: one request, then
  // half-close; the wire is the same, and the generic stub is the public way
  // to read responses as raw ByteBuffers.
  stub.PrepareBidiStreamingCall(&context_, kFetchLayerMethod, grpc::StubOptions(), this);
  StartWriteLast(&request_, grpc::WriteOptions());
  StartRead(&incoming_);
  StartCall();
}

void ShardStream::OnReadDone(bool ok) {
  if (!ok) return;  // the stream ended; OnDone follows with its status
  absl::StatusOr<uint64_t> placed = decoder_.Accept(incoming_);
  incoming_.Clear();
  if (!placed.ok()) {
    protocol_error_ = placed.status();
    context_.TryCancel();
    return;
  }
  if (on_chunk_) on_chunk_(*placed);
  StartRead(&incoming_);
}

void ShardStream::OnDone(const grpc::Status& status) {
  const auto& metadata = context_.GetServerInitialMetadata();
  if (const auto it = metadata.find(wire::kIncarnationMetadata); it != metadata.end()) {
    incarnation_ = wire::ParseIncarnation(absl::string_view(it->second.data(), it->second.size()));
  }
  if (!protocol_error_.ok()) {
    status_ = absl::Status(protocol_error_.code(),
                           absl::StrCat(describe_, " ", protocol_error_.message()));
  } else if (!status.ok()) {
    status_ = wire::FromGrpcStatus(status, describe_);
  } else if (const wire::ChunkDecoder::Run* run = decoder_.next_run(); run != nullptr) {
    status_ = absl::DataLossError(absl::StrCat(
        describe_, " ended its stream early: tensor ", run->tensor, " stopped at element ",
        decoder_.next_element(), " of its owned range ending at ", run->elements.end));
  }
  // Last, and from a copy: the gather may destroy this stream as soon as the
  // callback has signalled it.
  const std::function<void()> done = on_done_;
  done();
}

}  // namespace layercast::client
