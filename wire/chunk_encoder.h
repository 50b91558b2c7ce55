#pragma once

#include <cstdint>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

namespace layercast::wire {

// Frames a layercast.v1.LayerChunk around bytes that are already in a gRPC
// slice, without copying them: a few header bytes (tensor, element_offset,
// the length of data), the data slice itself, then the version and the
// data's CRC-32C `crc32c`. With `scale_bytes`, the last that many bytes of
// `data` are an 8-bit float chunk's block scales: they go as field 9
// (LayerChunk.scales, after the CRC, which covers both) and the rest as
// field 3. The result parses as an ordinary LayerChunk (field order 1, 2,
// 3, 4, 5, 9), so every client generated from shard.proto reads it.
//
// Why not LayerChunk::SerializeToString: protobuf would copy the chunk once
// into the message and gRPC again into its own buffer; this way the cast
// writes the bytes once, into the slice that goes on the wire.
grpc::ByteBuffer EncodeLayerChunk(uint32_t tensor, uint64_t element_offset, uint64_t version,
                                  uint32_t crc32c, const grpc::Slice& data,
                                  uint64_t scale_bytes = 0);

}  // namespace layercast::wire
