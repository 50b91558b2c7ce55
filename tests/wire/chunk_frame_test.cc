// The LayerChunk frame both ways: what the shard's encoder writes is an
// ordinary LayerChunk, and the worker's decoder places it exactly.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "core/crc32c.h"
#include "layercast/v1/shard.pb.h"
#include "wire/chunk_decoder.h"
#include "wire/chunk_encoder.h"

namespace layercast::wire {
namespace {

// The frames must parse as ordinary LayerChunks: outside clients generated
// from shard.proto read them with protobuf.
TEST(ChunkFrameTest, EncodedFrameParsesAsALayerChunk) {
  struct Case {
    uint32_t tensor;
    uint64_t offset, version;
    size_t bytes;
  };
  for (const Case& c :
       {Case{0, 0, 0, 2}, Case{7, 123456789012ull, 3, 1000}, Case{4000000000u, 1, 0, 1 << 20}}) {
    std::vector<uint8_t> data(c.bytes);
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 31 + 7);
    const uint32_t crc = Crc32c(data.data(), data.size());
    const grpc::ByteBuffer frame =
        EncodeLayerChunk(c.tensor, c.offset, c.version, crc, grpc::Slice(data.data(), data.size()));
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(frame.Dump(&slices).ok());
    std::string bytes;
    for (const grpc::Slice& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    }
    layercast::v1::LayerChunk chunk;
    ASSERT_TRUE(chunk.ParseFromString(bytes));
    EXPECT_EQ(chunk.tensor(), c.tensor);
    EXPECT_EQ(chunk.element_offset(), c.offset);
    EXPECT_EQ(chunk.version(), c.version);
    ASSERT_TRUE(chunk.has_crc32c());
    EXPECT_EQ(chunk.crc32c(), crc);
    EXPECT_EQ(chunk.data(), std::string(data.begin(), data.end()));
    // Byte for byte what protobuf itself would send.
    EXPECT_EQ(bytes, chunk.SerializeAsString());
  }
}

grpc::ByteBuffer Frame(uint32_t tensor, uint64_t offset, uint64_t version,
                       const std::vector<uint8_t>& data) {
  return EncodeLayerChunk(tensor, offset, version, Crc32c(data.data(), data.size()),
                          grpc::Slice(data.data(), data.size()));
}

// Two runs, each sent in two chunks by the encoder, arrive where the runs say
// and nowhere else, and the decoder reports the version and completion.
TEST(ChunkFrameTest, RoundTripPlacesEveryChunkExactly) {
  // Tensor 0: 2-byte elements at byte 0, elements [3, 10); tensor 2: 4-byte
  // elements at byte 256, elements [0, 5).
  const std::vector<ChunkDecoder::Run> runs = {{0, ElementRange{3, 10}, 0, 2},
                                               {2, ElementRange{0, 5}, 256, 4}};
  std::vector<uint8_t> buffer(512, 0xEE);
  ChunkDecoder decoder(runs, buffer);
  std::vector<uint8_t> values(64);
  std::iota(values.begin(), values.end(), 1);
  const auto slice = [&](size_t begin, size_t end) {
    return std::vector<uint8_t>(values.begin() + begin, values.begin() + end);
  };
  struct Sent {
    uint32_t tensor;
    uint64_t element;
    std::vector<uint8_t> data;
  };
  const std::vector<Sent> sent = {
      {0, 3, slice(0, 8)}, {0, 7, slice(8, 14)}, {2, 0, slice(14, 22)}, {2, 2, slice(22, 34)}};
  for (const Sent& chunk : sent) {
    ASSERT_FALSE(decoder.done());
    grpc::ByteBuffer frame = Frame(chunk.tensor, chunk.element, 9, chunk.data);
    absl::StatusOr<uint64_t> placed = decoder.Accept(frame);
    ASSERT_TRUE(placed.ok()) << placed.status();
    EXPECT_EQ(*placed, chunk.data.size());
  }
  EXPECT_TRUE(decoder.done());
  EXPECT_EQ(decoder.version(), 9u);
  EXPECT_TRUE(decoder.RemainingRuns().empty());
  for (size_t b = 0; b < buffer.size(); ++b) {
    uint8_t expected = 0xEE;
    if (b >= 6 && b < 20) expected = values[b - 6];              // tensor 0, elements 3..9
    if (b >= 256 && b < 276) expected = values[14 + (b - 256)];  // tensor 2, elements 0..4
    ASSERT_EQ(buffer[b], expected) << "byte " << b;
  }
}

// A frame whose checksum does not hold is refused and not counted: the
// remaining runs still start at its first element.
TEST(ChunkFrameTest, CorruptFrameIsRefusedAndResumable) {
  const std::vector<ChunkDecoder::Run> runs = {{1, ElementRange{0, 4}, 0, 4}};
  std::vector<uint8_t> buffer(256);
  ChunkDecoder decoder(runs, buffer);
  std::vector<uint8_t> data(16, 7);
  const grpc::Slice slice(data.data(), data.size());
  grpc::ByteBuffer frame = EncodeLayerChunk(1, 0, 1, Crc32c(data.data(), data.size()) ^ 1, slice);
  absl::StatusOr<uint64_t> placed = decoder.Accept(frame);
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kDataLoss) << placed.status();
  ASSERT_EQ(decoder.RemainingRuns().size(), 1u);
  EXPECT_EQ(decoder.RemainingRuns()[0].elements, (ElementRange{0, 4}));
}

// An 8-bit float chunk: codes and block scales from one slice, sent as
// fields 3 and 9 (protobuf's own serialisation, byte for byte) under one
// CRC, placed by the decoder at the codes' place and at their blocks'
// scales; a chunk without its scales, with the wrong number of them, or
// with a scale changed is refused and leaves the run due.
TEST(ChunkFrameTest, Float8ChunksCarryTheScalesOfTheirBlocks) {
  // Elements [5, 70) of a tensor in blocks of 16: blocks 0-4, five scales.
  constexpr uint64_t kCodes = 65, kScales = 5;
  std::vector<uint8_t> payload(kCodes + kScales * sizeof(float));
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 13 + 1);
  const uint32_t crc = Crc32c(payload.data(), payload.size());
  const grpc::Slice slice(payload.data(), payload.size());
  grpc::ByteBuffer encoded = EncodeLayerChunk(1, 5, 9, crc, slice, kScales * sizeof(float));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(encoded.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  layercast::v1::LayerChunk chunk;
  ASSERT_TRUE(chunk.ParseFromString(bytes));
  EXPECT_EQ(chunk.data(), std::string(payload.begin(), payload.begin() + kCodes));
  EXPECT_EQ(chunk.scales(), std::string(payload.begin() + kCodes, payload.end()));
  EXPECT_EQ(bytes, chunk.SerializeAsString());

  // Codes at 256, scales at 512 of a 1 KiB buffer.
  const std::vector<ChunkDecoder::Run> runs = {{.tensor = 1,
                                                .elements = {5, 70},
                                                .byte_offset = 256,
                                                .element_size = 1,
                                                .block_size = 16,
                                                .scale_offset = 512}};
  std::vector<uint8_t> buffer(1024, 0xAA);
  {
    ChunkDecoder decoder(runs, buffer);
    grpc::ByteBuffer without_scales = EncodeLayerChunk(1, 5, 9, Crc32c(payload.data(), kCodes),
                                                       grpc::Slice(payload.data(), kCodes));
    const absl::StatusOr<uint64_t> accepted = decoder.Accept(without_scales);
    EXPECT_EQ(accepted.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(accepted.status().message()),
                ::testing::HasSubstr("without the block scales of its 8-bit codes"));
    EXPECT_FALSE(decoder.done());
  }
  {
    ChunkDecoder decoder(runs, buffer);
    std::vector<uint8_t> short_payload(payload.begin(), payload.end() - sizeof(float));
    grpc::ByteBuffer too_few = EncodeLayerChunk(
        1, 5, 9, Crc32c(short_payload.data(), short_payload.size()),
        grpc::Slice(short_payload.data(), short_payload.size()), (kScales - 1) * sizeof(float));
    const absl::StatusOr<uint64_t> accepted = decoder.Accept(too_few);
    EXPECT_EQ(accepted.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(accepted.status().message()),
                ::testing::HasSubstr("16 bytes of block scales for elements [5, 70) of tensor 1, "
                                     "which touch 5 blocks of 16 (20 bytes)"));
    EXPECT_FALSE(decoder.done());
  }
  {
    ChunkDecoder decoder(runs, buffer);
    std::vector<uint8_t> corrupt = payload;
    corrupt.back() ^= 1;  // a scale, which the CRC covers too
    grpc::ByteBuffer bad = EncodeLayerChunk(
        1, 5, 9, crc, grpc::Slice(corrupt.data(), corrupt.size()), kScales * sizeof(float));
    const absl::StatusOr<uint64_t> accepted = decoder.Accept(bad);
    EXPECT_EQ(accepted.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(accepted.status().message()),
                ::testing::HasSubstr("does not match its data and block scales"));
    EXPECT_FALSE(decoder.done());
  }
  std::fill(buffer.begin(), buffer.end(), 0xAA);
  ChunkDecoder decoder(runs, buffer);
  ASSERT_TRUE(decoder.Accept(encoded).ok());
  EXPECT_TRUE(decoder.done());
  EXPECT_TRUE(std::equal(payload.begin(), payload.begin() + kCodes, buffer.begin() + 256 + 5));
  EXPECT_TRUE(std::equal(payload.begin() + kCodes, payload.end(), buffer.begin() + 512));
  // Nothing else was written.
  for (size_t i = 0; i < buffer.size(); ++i) {
    const bool codes = i >= 256 + 5 && i < 256 + 70;
    const bool scales = i >= 512 && i < 512 + kScales * sizeof(float);
    if (!codes && !scales) {
      ASSERT_EQ(buffer[i], 0xAA) << i;
    }
  }
}

}  // namespace
}  // namespace layercast::wire
