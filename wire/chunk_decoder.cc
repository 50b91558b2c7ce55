#include "wire/chunk_decoder.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "layercast/v1/shard.pb.h"
#include "wire/delta_chunks.h"

namespace layercast::wire {
namespace {

using google::protobuf::internal::WireFormatLite;

// Small enough to stay in the core's cache between the copy and the
// checksum; a multiple of Crc32c's three-stripe block (12 KiB).
constexpr uint32_t kChecksumBlockBytes = 48 << 10;

}  // namespace

ChunkDecoder::ChunkDecoder(std::vector<Run> runs, std::span<uint8_t> buffer,
                           std::optional<uint64_t> base_version)
    : runs_(std::move(runs)), buffer_(buffer), base_version_(base_version) {
  if (!runs_.empty()) next_element_ = runs_[0].elements.begin;
}

absl::StatusOr<uint8_t*> ChunkDecoder::Destination(uint32_t tensor, uint64_t offset,
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

void ChunkDecoder::Advance(uint64_t bytes) {
  next_element_ += bytes / runs_[run_].element_size;
  if (next_element_ == runs_[run_].elements.end && ++run_ < runs_.size()) {
    next_element_ = runs_[run_].elements.begin;
  }
}

absl::Status ChunkDecoder::CheckVersion(uint64_t version) {
  if (version_.has_value() && *version_ != version) {
    return absl::DataLossError(absl::StrCat("switched parameter version from ", *version_, " to ",
                                            version, " within one stream"));
  }
  version_ = version;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ChunkDecoder::AcceptDelta(grpc::ByteBuffer& chunk) {
  const uint64_t size = chunk.Length();
  layercast::v1::LayerChunk parsed;
  grpc::ProtoBufferReader reader(&chunk);
  if (!parsed.ParseFromZeroCopyStream(&reader)) {
    return absl::DataLossError("sent a chunk that is not a valid LayerChunk");
  }
  if (!parsed.has_base_version() || parsed.base_version() != *base_version_) {
    return absl::DataLossError(absl::StrCat(
        "sent ",
        parsed.has_base_version() ? absl::StrCat("a delta from version ", parsed.base_version())
                                  : "a full chunk",
        " where a delta from version ", *base_version_, " was due"));
  }
  const size_t element_size = done() ? 1 : runs_[run_].element_size;
  if (parsed.span_elements() > UINT64_MAX / element_size) {
    return absl::DataLossError("sent a delta chunk with an impossible span");
  }
  const uint64_t span_bytes = parsed.span_elements() * element_size;
  absl::StatusOr<uint8_t*> place =
      Destination(parsed.tensor(), parsed.element_offset(), span_bytes);
  if (!place.ok()) return place.status();
  if (absl::Status version = CheckVersion(parsed.version()); !version.ok()) return version;
  // The scales a delta of an 8-bit float span may move: those of every
  // block it touches, as the shard counts them.
  std::span<uint8_t> scales;
  if (const Run& run = runs_[run_]; run.block_size != 0 && parsed.span_elements() != 0) {
    const uint64_t first = parsed.element_offset() / run.block_size;
    const uint64_t end =
        (parsed.element_offset() + parsed.span_elements() + run.block_size - 1) / run.block_size;
    scales =
        buffer_.subspan(run.scale_offset + first * sizeof(float), (end - first) * sizeof(float));
  }
  absl::StatusOr<uint64_t> applied =
      ApplyDeltaChunk(parsed, element_size, std::span<uint8_t>(*place, span_bytes), scales);
  if (!applied.ok()) return applied.status();
  changed_elements_ += *applied;
  Advance(span_bytes);
  return size;
}

absl::Status ChunkDecoder::PlaceScales(google::protobuf::io::CodedInputStream& in, const Run& run,
                                       ElementRange elements, uint32_t* crc) {
  uint32_t size = 0;
  if (!in.ReadVarint32(&size))
    return absl::DataLossError("sent a chunk that is not a valid LayerChunk");
  if (run.block_size == 0) {
    return absl::DataLossError(absl::StrCat("sent block scales for tensor ", run.tensor,
                                            ", which is not in an 8-bit float"));
  }
  const uint64_t first = elements.begin / run.block_size;
  const uint64_t blocks = (elements.end + run.block_size - 1) / run.block_size - first;
  if (size != blocks * sizeof(float)) {
    return absl::DataLossError(
        absl::StrCat("sent ", size, " bytes of block scales for elements [", elements.begin, ", ",
                     elements.end, ") of tensor ", run.tensor, ", which touch ", blocks,
                     " blocks of ", run.block_size, " (", blocks * sizeof(float), " bytes)"));
  }
  uint8_t* destination = buffer_.data() + run.scale_offset + first * sizeof(float);
  if (!in.ReadRaw(destination, static_cast<int>(size))) {
    return absl::DataLossError("sent a chunk that is not a valid LayerChunk");
  }
  *crc = Crc32c(destination, size, *crc);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ChunkDecoder::Accept(grpc::ByteBuffer& chunk) {
  if (base_version_) return AcceptDelta(chunk);
  grpc::ProtoBufferReader reader(&chunk);
  google::protobuf::io::CodedInputStream in(&reader);
  uint32_t tensor = 0, crc = 0, data_crc = 0;
  uint64_t offset = 0, version = 0;
  bool placed = false, has_crc = false, has_scales = false;
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
    } else if (field == 9 && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED && placed &&
               !has_scales) {
      // After the data, so the elements whose blocks these are are known.
      const Run& run = runs_[run_];
      const ElementRange elements{offset, offset + size / run.element_size};
      if (absl::Status scales = PlaceScales(in, run, elements, &data_crc); !scales.ok()) {
        return scales;
      }
      has_scales = true;
    } else if (field == 3 && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED && !placed) {
      ok = in.ReadVarint32(&size);
      if (ok) {
        absl::StatusOr<uint8_t*> place = Destination(tensor, offset, size);
        if (!place.ok()) return place.status();
        uint8_t* destination = *place;
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
  if (runs_[run_].block_size != 0 && !has_scales) {
    return absl::DataLossError(absl::StrCat("sent tensor ", tensor, " from element ", offset,
                                            " without the block scales of its 8-bit codes"));
  }
  // Counted as received only once its checksum holds: a retry resumes from
  // the first chunk that did not arrive intact.
  if (has_crc && data_crc != crc) {
    return absl::DataLossError(absl::StrCat("sent tensor ", tensor, " from element ", offset,
                                            " with a CRC-32C that does not match its data",
                                            has_scales ? " and block scales" : ""));
  }
  if (absl::Status checked = CheckVersion(version); !checked.ok()) return checked;
  changed_elements_ += size / runs_[run_].element_size;
  Advance(size);
  return size;
}

std::vector<ChunkDecoder::Run> ChunkDecoder::RemainingRuns() const {
  std::vector<Run> remaining(runs_.begin() + static_cast<std::ptrdiff_t>(run_), runs_.end());
  if (!remaining.empty()) remaining.front().elements.begin = next_element_;
  return remaining;
}

}  // namespace layercast::wire
