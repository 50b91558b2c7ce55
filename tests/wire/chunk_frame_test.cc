// The LayerChunk frame both ways: what the shard's encoder writes is an
// ordinary LayerChunk, and the worker's decoder places it exactly.

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace layercast::wire
