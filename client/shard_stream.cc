#include "client/shard_stream.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace layercast::client {

ShardStream::ShardStream(std::string describe, std::vector<Run> runs, std::span<uint8_t> buffer,
                         std::function<void()> on_done)
    : describe_(std::move(describe)),
      runs_(std::move(runs)),
      buffer_(buffer),
      on_done_(std::move(on_done)) {
  if (!runs_.empty()) next_element_ = runs_[0].elements.begin;
}

void ShardStream::Start(layercast::v1::ShardService::Stub& stub,
                        const layercast::v1::FetchLayerRequest& request,
                        std::chrono::system_clock::time_point deadline) {
  request_ = request;
  context_.set_deadline(deadline);
  stub.async()->FetchLayer(&context_, &request_, this);
  StartRead(&chunk_);
  StartCall();
}

absl::Status ShardStream::Accept(const layercast::v1::LayerChunk& chunk) {
  if (run_ == runs_.size()) {
    return absl::DataLossError(absl::StrCat("sent a chunk of tensor ", chunk.tensor(),
                                            " after all the elements it owns"));
  }
  const Run& run = runs_[run_];
  if (chunk.tensor() != run.tensor || chunk.element_offset() != next_element_) {
    return absl::DataLossError(absl::StrCat(
        "sent tensor ", chunk.tensor(), " from element ", chunk.element_offset(),
        " where tensor ", run.tensor, " from element ", next_element_, " was due"));
  }
  const std::string& data = chunk.data();
  const uint64_t remaining = run.elements.end - next_element_;
  if (data.empty() || data.size() % run.element_size != 0 ||
      data.size() / run.element_size > remaining) {
    return absl::DataLossError(absl::StrCat("sent ", data.size(), " bytes for tensor ",
                                            run.tensor, " where at most ", remaining,
                                            " elements of ", run.element_size, " bytes remain"));
  }
  if (version_.has_value() && *version_ != chunk.version()) {
    return absl::DataLossError(absl::StrCat("switched parameter version from ", *version_, " to ",
                                            chunk.version(), " within one stream"));
  }
  version_ = chunk.version();
  std::memcpy(buffer_.data() + run.byte_offset + next_element_ * run.element_size, data.data(),
              data.size());
  next_element_ += data.size() / run.element_size;
  if (next_element_ == run.elements.end && ++run_ < runs_.size()) {
    next_element_ = runs_[run_].elements.begin;
  }
  return absl::OkStatus();
}

void ShardStream::OnReadDone(bool ok) {
  if (!ok) return;  // the stream ended; OnDone follows with its status
  protocol_error_ = Accept(chunk_);
  if (!protocol_error_.ok()) {
    context_.TryCancel();
    return;
  }
  StartRead(&chunk_);
}

void ShardStream::OnDone(const grpc::Status& status) {
  if (!protocol_error_.ok()) {
    status_ = absl::Status(protocol_error_.code(),
                           absl::StrCat(describe_, " ", protocol_error_.message()));
  } else if (!status.ok()) {
    status_ = absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                           absl::StrCat(describe_, ": ", status.error_message()));
  } else if (run_ != runs_.size()) {
    status_ = absl::DataLossError(absl::StrCat(
        describe_, " ended its stream early: tensor ", runs_[run_].tensor, " stopped at element ",
        next_element_, " of its owned range ending at ", runs_[run_].elements.end));
  }
  // Last, and from a copy: the gather may destroy this stream as soon as the
  // callback has signalled it.
  const std::function<void()> done = on_done_;
  done();
}

}  // namespace layercast::client
