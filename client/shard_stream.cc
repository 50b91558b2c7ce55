#include "client/shard_stream.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"

namespace layercast::client {
namespace {

using google::protobuf::internal::WireFormatLite;

constexpr char kFetchLayerMethod[] = "/layercast.v1.ShardService/FetchLayer";

// Small enough to stay in the core's cache between the copy and the
// checksum; a multiple of Crc32c's three-stripe block (12 KiB).
constexpr uint32_t kChecksumBlockBytes = 48 << 10;

}  // namespace

ShardStream::ShardStream(std::string describe, std::vector<Run> runs, std::span<uint8_t> buffer,
                         std::function<void()> on_done,
                         std::function<void(uint64_t bytes)> on_chunk)
    : describe_(std::move(describe)),
      runs_(std::move(runs)),
      buffer_(buffer),
      on_done_(std::move(on_done)),
      on_chunk_(std::move(on_chunk)) {
  if (!runs_.empty()) next_element_ = runs_[0].elements.begin;
}

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

absl::StatusOr<uint8_t*> ShardStream::Destination(uint32_t tensor, uint64_t offset,
                                                  uint64_t bytes) {
  if (run_ == runs_.size()) {
    return absl::DataLossError(
        absl::StrCat("sent a chunk of tensor ", tensor, " after all the elements it owns"));
  }
  const Run& run = runs_[run_];
  if (tensor != run.tensor || offset != next_element_) {
    return absl::DataLossError(absl::StrCat("sent tensor ", tensor, " from element ", offset,
                                            " where tensor ", run.tensor, " from element ",
                                            next_element_, " was due"));
  }
  const uint64_t remaining = run.elements.end - next_element_;
  if (bytes == 0 || bytes % run.element_size != 0 || bytes / run.element_size > remaining) {
    return absl::DataLossError(absl::StrCat("sent ", bytes, " bytes for tensor ", run.tensor,
                                            " where at most ", remaining, " elements of ",
                                            run.element_size, " bytes remain"));
  }
  return buffer_.data() + run.byte_offset + next_element_ * run.element_size;
}

void ShardStream::Advance(uint64_t bytes) {
  next_element_ += bytes / runs_[run_].element_size;
  if (next_element_ == runs_[run_].elements.end && ++run_ < runs_.size()) {
    next_element_ = runs_[run_].elements.begin;
  }
}

absl::Status ShardStream::Accept(grpc::ByteBuffer& chunk) {
  grpc::ProtoBufferReader reader(&chunk);
  google::protobuf::io::CodedInputStream in(&reader);
  uint32_t tensor = 0, crc = 0, data_crc = 0;
  uint64_t offset = 0, version = 0;
  bool placed = false, has_crc = false;
  uint8_t* destination = nullptr;
  uint32_t size = 0;
  // Fields are read in the order protobuf serializers write them (field
  // number order: tensor, element_offset, data, version), so the data's place
  // is known when it arrives and it is copied once, straight there. A peer
  // sending tensor or offset after the data is refused rather than guessed.
  while (const uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const auto type = WireFormatLite::GetTagWireType(tag);
    bool ok = true;
    if ((field == 1 || field == 2) && placed) {
      return absl::DataLossError(
          "sent tensor or element_offset after data; LayerChunk fields must be in field order");
    } else if (field == 1 && type == WireFormatLite::WIRETYPE_VARINT) {
      ok = in.ReadVarint32(&tensor);
    } else if (field == 2 && type == WireFormatLite::WIRETYPE_VARINT) {
      ok = in.ReadVarint64(&offset);
    } else if (field == 4 && type == WireFormatLite::WIRETYPE_VARINT) {
      ok = in.ReadVarint64(&version);
    } else if (field == 5 && type == WireFormatLite::WIRETYPE_FIXED32) {
      ok = in.ReadLittleEndian32(&crc);
      has_crc = ok;
    } else if (field == 3 && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED && !placed) {
      ok = in.ReadVarint32(&size);
      if (ok) {
        absl::StatusOr<uint8_t*> place = Destination(tensor, offset, size);
        if (!place.ok()) return place.status();
        destination = *place;
        // The checksum follows the data on the wire, so it is computed as the
        // data is placed, a cache-sized block at a time, rather than by
        // reading the whole chunk back from memory afterwards.
        for (uint32_t done = 0; ok && done < size;) {
          const uint32_t block = std::min(kChecksumBlockBytes, size - done);
          ok = in.ReadRaw(destination + done, static_cast<int>(block));
          data_crc = Crc32c(destination + done, block, data_crc);
          done += block;
        }
        placed = ok;
      }
    } else {
      ok = WireFormatLite::SkipField(&in, tag);
    }
    if (!ok) return absl::DataLossError("sent a chunk that is not a valid LayerChunk");
  }
  if (!placed) return absl::DataLossError("sent a chunk without data");
  // Counted as received only once its checksum holds: a retry resumes from
  // the first chunk that did not arrive intact.
  if (has_crc && data_crc != crc) {
    return absl::DataLossError(absl::StrCat("sent tensor ", tensor, " from element ", offset,
                                            " with a CRC-32C that does not match its data"));
  }
  if (version_.has_value() && *version_ != version) {
    return absl::DataLossError(absl::StrCat("switched parameter version from ", *version_, " to ",
                                            version, " within one stream"));
  }
  version_ = version;
  Advance(size);
  if (on_chunk_) on_chunk_(size);
  return absl::OkStatus();
}

std::vector<ShardStream::Run> ShardStream::RemainingRuns() const {
  std::vector<Run> remaining(runs_.begin() + static_cast<std::ptrdiff_t>(run_), runs_.end());
  if (!remaining.empty()) remaining.front().elements.begin = next_element_;
  return remaining;
}

void ShardStream::OnReadDone(bool ok) {
  if (!ok) return;  // the stream ended; OnDone follows with its status
  protocol_error_ = Accept(incoming_);
  incoming_.Clear();
  if (!protocol_error_.ok()) {
    context_.TryCancel();
    return;
  }
  StartRead(&incoming_);
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
