#include "wire/chunk_encoder.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>

namespace layercast::wire {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedOutputStream;

uint8_t* Varint(uint64_t value, uint8_t* out) {
  return CodedOutputStream::WriteVarint64ToArray(value, out);
}

uint8_t* Tag(int field, WireFormatLite::WireType type, uint8_t* out) {
  return CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(field, type), out);
}

}  // namespace

grpc::ByteBuffer EncodeLayerChunk(uint32_t tensor, uint64_t element_offset, uint64_t version,
                                  uint32_t crc32c, const grpc::Slice& data, uint64_t scale_bytes) {
  const size_t value_bytes = data.size() - scale_bytes;
  // Three tags and three varints: at most 3 + 3 * 10 bytes.
  uint8_t header[40];
  uint8_t* end = header;
  // proto3 omits fields equal to their default; so do we, like protobuf.
  if (tensor != 0) end = Varint(tensor, Tag(1, WireFormatLite::WIRETYPE_VARINT, end));
  if (element_offset != 0) {
    end = Varint(element_offset, Tag(2, WireFormatLite::WIRETYPE_VARINT, end));
  }
  end = Varint(value_bytes, Tag(3, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, end));
  uint8_t trailer[40];
  uint8_t* trailer_end = trailer;
  if (version != 0) trailer_end = Varint(version, Tag(4, WireFormatLite::WIRETYPE_VARINT, trailer));
  // `optional`: present even when zero.
  trailer_end = CodedOutputStream::WriteLittleEndian32ToArray(
      crc32c, Tag(5, WireFormatLite::WIRETYPE_FIXED32, trailer_end));
  if (scale_bytes == 0) {
    const grpc::Slice slices[] = {
        grpc::Slice(header, static_cast<size_t>(end - header)),
        data,
        grpc::Slice(trailer, static_cast<size_t>(trailer_end - trailer)),
    };
    return grpc::ByteBuffer(slices, 3);
  }
  trailer_end = Varint(scale_bytes, Tag(9, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, trailer_end));
  // Both parts share `data`'s bytes (sub() takes a reference, no copy).
  const grpc::Slice slices[] = {
      grpc::Slice(header, static_cast<size_t>(end - header)),
      data.sub(0, value_bytes),
      grpc::Slice(trailer, static_cast<size_t>(trailer_end - trailer)),
      data.sub(value_bytes, data.size()),
  };
  return grpc::ByteBuffer(slices, 4);
}

}  // namespace layercast::wire
