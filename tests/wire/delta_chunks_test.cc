// Delta chunks alone: what is encoded applies back exactly, and a chunk
// whose bitmap, values or checksum do not hold is refused writing nothing.

#include "wire/delta_chunks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <random>

namespace layercast::wire {
namespace {

using ::testing::HasSubstr;

layercast::v1::LayerChunk Parse(const grpc::Slice& slice) {
  layercast::v1::LayerChunk chunk;
  EXPECT_TRUE(chunk.ParseFromArray(slice.begin(), static_cast<int>(slice.size())));
  return chunk;
}

struct Example {
  std::vector<uint8_t> old_values, new_values;
  std::vector<uint64_t> changed;
  uint64_t count = 0;
};

// `span` bfloat16 elements, about `share` of them changed.
Example MakeExample(uint64_t span, double share) {
  std::mt19937 random(static_cast<uint32_t>(span));
  std::bernoulli_distribution pick(share);
  Example example{std::vector<uint8_t>(span * 2), {}, std::vector<uint64_t>((span + 63) / 64)};
  for (uint8_t& byte : example.old_values) byte = static_cast<uint8_t>(random());
  example.new_values = example.old_values;
  for (uint64_t i = 0; i < span; ++i) {
    if (!pick(random)) continue;
    example.new_values[2 * i] ^= 1;
    example.changed[i / 64] |= uint64_t{1} << (i % 64);
    ++example.count;
  }
  return example;
}

TEST(DeltaChunksTest, AppliesBackToTheNewValues) {
  for (const uint64_t span : {1, 7, 64, 65, 1000}) {
    for (const double share : {0.0, 0.01, 0.5, 1.0}) {
      Example example = MakeExample(span, share);
      const grpc::Slice slice = EncodeDeltaChunk({.tensor = 2,
                                                  .element_offset = 10,
                                                  .span_elements = span,
                                                  .version = 5,
                                                  .base_version = 3},
                                                 example.new_values, 2, example.changed);
      const layercast::v1::LayerChunk chunk = Parse(slice);
      EXPECT_EQ(chunk.base_version(), 3u);
      EXPECT_EQ(chunk.version(), 5u);
      EXPECT_EQ(chunk.changed().size(), (span + 7) / 8);
      EXPECT_EQ(chunk.data().size(), 2 * example.count);
      // The whole chunk: values, bitmap and a few bytes of header.
      EXPECT_LE(slice.size(), 2 * example.count + (span + 7) / 8 + 32);
      std::vector<uint8_t> copy = example.old_values;
      absl::StatusOr<uint64_t> applied = ApplyDeltaChunk(chunk, 2, copy);
      ASSERT_TRUE(applied.ok()) << applied.status();
      EXPECT_EQ(*applied, example.count);
      EXPECT_EQ(copy, example.new_values) << span << " elements, share " << share;
      // Again, or over the new values: nothing more changes.
      ASSERT_TRUE(ApplyDeltaChunk(chunk, 2, copy).ok());
      EXPECT_EQ(copy, example.new_values);
    }
  }
}

TEST(DeltaChunksTest, RefusesABrokenChunkWritingNothing) {
  Example example = MakeExample(100, 0.3);
  const layercast::v1::LayerChunk good =
      Parse(EncodeDeltaChunk({.span_elements = 100, .version = 1, .base_version = 0},
                             example.new_values, 2, example.changed));
  const auto refused = [&](layercast::v1::LayerChunk chunk, const std::string& why) {
    std::vector<uint8_t> copy = example.old_values;
    absl::StatusOr<uint64_t> applied = ApplyDeltaChunk(chunk, 2, copy);
    EXPECT_EQ(applied.status().code(), absl::StatusCode::kDataLoss) << why;
    EXPECT_EQ(copy, example.old_values) << why << ": something was written";
    return std::string(applied.status().message());
  };
  layercast::v1::LayerChunk chunk = good;
  chunk.mutable_changed()->pop_back();
  EXPECT_THAT(refused(chunk, "short bitmap"), HasSubstr("bitmap"));
  chunk = good;
  chunk.mutable_changed()->back() |= static_cast<char>(0x80);  // element 103 of 100
  EXPECT_THAT(refused(chunk, "bit past the span"), HasSubstr("past its span"));
  chunk = good;
  chunk.mutable_data()->push_back('x');
  EXPECT_THAT(refused(chunk, "extra value"), HasSubstr("bytes of values"));
  chunk = good;
  (*chunk.mutable_data())[0] ^= 1;
  EXPECT_THAT(refused(chunk, "corrupted value"), HasSubstr("CRC-32C"));
  chunk = good;
  (*chunk.mutable_changed())[0] ^= 1;
  chunk.mutable_data()->resize(chunk.data().size() + ((chunk.changed()[0] & 1) ? 2 : -2));
  EXPECT_EQ(refused(chunk, "moved bit").empty(), false);
  std::vector<uint8_t> wrong_size(10);
  EXPECT_FALSE(ApplyDeltaChunk(good, 2, wrong_size).ok()) << "a destination not the span's";
}

}  // namespace
}  // namespace layercast::wire
