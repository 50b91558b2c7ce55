#include "wire/gradient_chunks.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "core/crc32c.h"
#include "wire/owned_runs.h"

namespace layercast::wire {
namespace {

using google::protobuf::internal::WireFormatLite;

// Calls `piece(data, size)` for the chunk's data, slice by slice as gRPC
// received it. REQUIRES: the view came from ReadGradientChunk.
template <typename Piece>
void ForEachPiece(const GradientChunkView& chunk, Piece piece) {
  grpc::ProtoBufferReader reader(chunk.encoded);
  reader.Skip(static_cast<int>(chunk.data_at));
  const void* data = nullptr;
  int size = 0;
  for (uint32_t left = chunk.data_bytes; left > 0 && reader.Next(&data, &size);) {
    const uint32_t take = std::min(left, static_cast<uint32_t>(size));
    piece(static_cast<const uint8_t*>(data), take);
    left -= take;
  }
}

}  // namespace

absl::StatusOr<GradientChunkView> ReadGradientChunk(grpc::ByteBuffer& encoded) {
  GradientChunkView chunk;
  chunk.encoded = &encoded;
  grpc::ProtoBufferReader reader(&encoded);
  google::protobuf::io::CodedInputStream in(&reader);
  bool has_data = false;
  while (const uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const auto type = WireFormatLite::GetTagWireType(tag);
    uint32_t value32 = 0;
    bool ok = true;
    if (field == 0) {
      ok = false;  // no field is numbered 0: not a protobuf message
    } else if (type == WireFormatLite::WIRETYPE_VARINT && (field == 1 || field == 5)) {
      ok = in.ReadVarint64(field == 1 ? &chunk.step : &chunk.element_offset);
    } else if (type == WireFormatLite::WIRETYPE_VARINT && field >= 2 && field <= 4) {
      ok = in.ReadVarint32(field == 2 ? &chunk.worker : field == 3 ? &chunk.layer : &chunk.tensor);
    } else if (type == WireFormatLite::WIRETYPE_VARINT && field == 7) {
      ok = in.ReadVarint32(&value32);  // an enum is an int32: a negative one reads truncated
      chunk.dtype = static_cast<int32_t>(value32);
    } else if (type == WireFormatLite::WIRETYPE_FIXED32 && field == 8) {
      ok = in.ReadLittleEndian32(&value32);
      chunk.crc32c = value32;
    } else if (type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED && field == 6) {
      // As a parser would, the last occurrence wins.
      ok = in.ReadVarint32(&chunk.data_bytes);
      chunk.data_at = static_cast<uint32_t>(in.CurrentPosition());
      ok = ok && in.Skip(static_cast<int>(chunk.data_bytes));
      has_data = ok;
    } else {
      ok = WireFormatLite::SkipField(&in, tag);
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("a chunk that is not a valid GradientChunk (field ", field, " at byte ",
                       in.CurrentPosition(),
                       " is cut short or malformed): send chunks encoded from the "
                       "layercast.v1 GradientChunk message"));
    }
  }
  if (!in.ConsumedEntireMessage()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk that is not a valid GradientChunk (an invalid tag at byte ", in.CurrentPosition(),
        "): send chunks encoded from the layercast.v1 GradientChunk message"));
  }
  if (!has_data) chunk.data_bytes = 0;
  return chunk;
}

GradientChunker::GradientChunker(const AssembledLayout& layout, std::span<const uint8_t> gradient,
                                 Stream stream, uint64_t chunk_bytes)
    : layout_(layout),
      gradient_(gradient),
      stream_(stream),
      chunk_bytes_(chunk_bytes),
      runs_(OwnedLayerRuns(layout, stream.shard, stream.num_shards)) {
  for (const TensorElementRange& run : runs_) {
    total_bytes_ += run.elements.size() * DTypeSize(layout_.tensors()[run.tensor].compute_dtype);
  }
  if (!runs_.empty()) next_element_ = runs_[0].elements.begin;
}

bool GradientChunker::Next(layercast::v1::GradientChunk* chunk) {
  if (runs_.empty() && !sent_empty_) {
    // The shard owns nothing of the layer, yet its step counts this push:
    // one chunk without data says which (step, worker, layer) it is.
    sent_empty_ = true;
    chunk->Clear();
    chunk->set_step(stream_.step);
    chunk->set_worker(stream_.worker);
    chunk->set_layer(stream_.layer);
    chunk->set_dtype(static_cast<layercast::v1::DType>(
        layout_.tensors().empty() ? DType::kFloat32 : layout_.tensors()[0].compute_dtype));
    return true;
  }
  if (run_ == runs_.size()) return false;
  const TensorElementRange& run = runs_[run_];
  const AssembledTensor& placed = layout_.tensors()[run.tensor];
  const uint64_t element_size = DTypeSize(placed.compute_dtype);
  const uint64_t count = std::min(run.elements.end - next_element_,
                                  std::max<uint64_t>(1, chunk_bytes_ / element_size));
  const uint8_t* data = gradient_.data() + placed.byte_offset + next_element_ * element_size;
  chunk->Clear();
  chunk->set_step(stream_.step);
  chunk->set_worker(stream_.worker);
  chunk->set_layer(stream_.layer);
  chunk->set_tensor(run.tensor);
  chunk->set_element_offset(next_element_);
  chunk->set_data(data, count * element_size);
  chunk->set_dtype(static_cast<layercast::v1::DType>(placed.compute_dtype));
  chunk->set_crc32c(Crc32c(data, count * element_size));
  next_element_ += count;
  if (next_element_ == run.elements.end && ++run_ < runs_.size()) {
    next_element_ = runs_[run_].elements.begin;
  }
  return true;
}

GradientDecoder::GradientDecoder(const AssembledLayout& layout,
                                 std::vector<TensorElementRange> owned, std::span<float> staging)
    : layout_(layout), runs_(std::move(owned)), staging_(staging) {
  if (!runs_.empty()) next_element_ = runs_[0].elements.begin;
}

std::string GradientDecoder::Due() const {
  if (done()) return "nothing more";
  return absl::StrCat("tensor ", runs_[run_].tensor, " from element ", next_element_);
}

absl::Status GradientDecoder::Accept(const GradientChunkView& chunk) {
  if (!started_) {
    started_ = true;
    step_ = chunk.step;
    worker_ = chunk.worker;
    layer_ = chunk.layer;
  } else if (chunk.step != step_ || chunk.worker != worker_ || chunk.layer != layer_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk for step ", chunk.step, ", worker ", chunk.worker, ", layer ", chunk.layer,
        " in a stream for step ", step_, ", worker ", worker_, ", layer ", layer_,
        ": one PushGradients stream carries one (step, worker, layer); open another"));
  }
  if (runs_.empty()) {  // the shard owns nothing of the layer
    if (!empty_taken_ && chunk.data_bytes == 0) {
      empty_taken_ = true;
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk of ", chunk.data_bytes, " bytes for a shard that owns no element of layer ",
        layer_, ": send it one chunk without data, which says (step, worker, layer)"));
  }
  if (done()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a chunk of tensor ", chunk.tensor, " from element ", chunk.element_offset,
                     " after every element this shard owns had arrived (a shard that owns no "
                     "element of the layer takes one chunk without data)"));
  }
  const TensorElementRange& run = runs_[run_];
  if (chunk.tensor != run.tensor || chunk.element_offset != next_element_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk of tensor ", chunk.tensor, " from element ", chunk.element_offset, " where ",
        Due(), " was due: send this shard's elements of each tensor once, in tensor and element ",
        "order (elements [n*i/N, n*(i+1)/N) of an n-element tensor for shard i of N)"));
  }
  const DType compute = layout_.tensors()[run.tensor].compute_dtype;
  const int wire_dtype = chunk.dtype;
  const bool known =
      layercast::v1::DType_IsValid(wire_dtype) && wire_dtype != layercast::v1::DTYPE_UNSPECIFIED;
  const auto dtype = static_cast<DType>(known ? wire_dtype : 0);
  // An 8-bit gradient has no block scales to give it values: FLOAT32 only.
  if (!known || (dtype != DType::kFloat32 && (dtype != compute || IsFloat8(dtype)))) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor ", run.tensor, "'s gradient came as ",
        layercast::v1::DType_IsValid(wire_dtype)
            ? layercast::v1::DType_Name(static_cast<layercast::v1::DType>(wire_dtype))
            : absl::StrCat("dtype ", wire_dtype),
        IsFloat8(compute) ? absl::StrCat("; the tensor computes in ", DTypeName(compute),
                                         ", so send its gradient in FLOAT32")
                          : absl::StrCat("; send it in the tensor's compute dtype ",
                                         DTypeName(compute), " or in FLOAT32")));
  }
  const uint64_t element_size = DTypeSize(dtype);
  const uint64_t bytes = chunk.data_bytes;
  const uint64_t remaining = run.elements.end - next_element_;
  if (bytes == 0 || bytes % element_size != 0 || bytes / element_size > remaining) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk of ", bytes, " bytes for tensor ", run.tensor, " where at most ", remaining,
        " elements of ", element_size, " bytes remain of what this shard owns"));
  }
  const uint64_t count = bytes / element_size;
  if (count > staging_.size() - staged_) {  // only if the caller broke the REQUIRES
    return absl::InternalError("the staging slice is smaller than the owned elements");
  }
  // The checksum first, so that nothing is written from data that fails it;
  // then the data is widened from the receive buffer's slices as they lie.
  if (chunk.crc32c.has_value()) {
    uint32_t crc = 0;
    ForEachPiece(chunk,
                 [&crc](const uint8_t* piece, size_t size) { crc = Crc32c(piece, size, crc); });
    if (crc != *chunk.crc32c) {
      return absl::DataLossError(absl::StrCat("the chunk of tensor ", run.tensor, " from element ",
                                              next_element_,
                                              " does not match its CRC-32C: send it again"));
    }
  }
  float* out = staging_.data() + staged_;
  uint8_t carry[sizeof(float)];  // an element split between two slices
  size_t carried = 0;
  ForEachPiece(chunk, [&](const uint8_t* piece, size_t size) {
    if (carried > 0) {
      const size_t take = std::min(element_size - carried, size);
      std::memcpy(carry + carried, piece, take);
      carried += take;
      piece += take;
      size -= take;
      if (carried == element_size) {
        CastToF32(carry, dtype, out++, 1);
        carried = 0;
      }
      if (size == 0) return;  // the element may go on in the next slice
    }
    const size_t whole = size / element_size;
    CastToF32(piece, dtype, out, whole);
    out += whole;
    carried = size - whole * element_size;
    std::memcpy(carry, piece + whole * element_size, carried);
  });
  staged_ += count;
  next_element_ += count;
  if (next_element_ == run.elements.end && ++run_ < runs_.size()) {
    next_element_ = runs_[run_].elements.begin;
  }
  return absl::OkStatus();
}

}  // namespace layercast::wire
