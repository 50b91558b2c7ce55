#include "server/chunk_encoder.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/crc32c.h"
#include "layercast/v1/shard.pb.h"

namespace layercast::server {
namespace {

// The frames must parse as ordinary LayerChunks: outside clients generated
// from shard.proto read them with protobuf.
TEST(ChunkEncoderTest, ParsesAsALayerChunk) {
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

}  // namespace
}  // namespace layercast::server
