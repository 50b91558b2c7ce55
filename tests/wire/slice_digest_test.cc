#include "wire/slice_digest.h"

#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <string>
#include <vector>

namespace layercast::wire {
namespace {

std::string Sha256(const std::string& bytes) {
  std::string digest(32, '\0');
  unsigned int length = 0;
  EVP_Digest(bytes.data(), bytes.size(), reinterpret_cast<unsigned char*>(digest.data()), &length,
             EVP_sha256(), nullptr);
  return digest;
}

std::string Str(const SliceDigest::Sha256& digest) { return {digest.begin(), digest.end()}; }

// The definition in proto/layercast/v1/shard.proto (LayerDigest.sha256),
// written out with plain SHA-256 calls: for each tensor with owned
// elements, its index (4 bytes LE) and the SHA-256 of its owned bytes.
TEST(SliceDigestTest, IsTheHashOfEachOwnedTensorsIndexAndHash) {
  // 7 bf16 and 3 fp32: shard 1 of 2 owns elements 3-6 and 1-2.
  const auto layout = AssembledLayout::FromDTypes({DType::kBFloat16, DType::kFloat32}, {7, 3});
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<uint8_t> buffer(layout->total_bytes());
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<uint8_t>(i * 7 + 1);
  const auto bytes_of = [&](uint32_t tensor, uint64_t begin, uint64_t end) {
    const AssembledTensor& t = layout->tensors()[tensor];
    const uint64_t width = DTypeSize(t.compute_dtype);
    return std::string(buffer.begin() + t.byte_offset + begin * width,
                       buffer.begin() + t.byte_offset + end * width);
  };
  const std::string expected = Sha256(std::string("\0\0\0\0", 4) + Sha256(bytes_of(0, 3, 7)) +
                                      std::string("\1\0\0\0", 4) + Sha256(bytes_of(1, 1, 3)));
  EXPECT_EQ(Str(SliceDigestOf(*layout, buffer, 1, 2)), expected);

  // Fed in pieces, as a shard feeds its chunks: the same.
  SliceDigest fed;
  fed.BeginTensor(0, false);
  const std::string first = bytes_of(0, 3, 7);
  fed.AddElements({reinterpret_cast<const uint8_t*>(first.data()), 3});
  fed.AddElements({reinterpret_cast<const uint8_t*>(first.data()) + 3, first.size() - 3});
  fed.BeginTensor(1, false);
  const std::string second = bytes_of(1, 1, 3);
  fed.AddElements({reinterpret_cast<const uint8_t*>(second.data()), second.size()});
  EXPECT_EQ(Str(fed.Finish()), expected);

  // One bit anywhere in a shard's slice changes its digest, and only its.
  const SliceDigest::Sha256 shard0 = SliceDigestOf(*layout, buffer, 0, 2);
  buffer[layout->tensors()[0].byte_offset + 4 * 2] ^= 0x40;  // element 4: shard 1's
  EXPECT_NE(Str(SliceDigestOf(*layout, buffer, 1, 2)), expected);
  EXPECT_EQ(Str(SliceDigestOf(*layout, buffer, 0, 2)), Str(shard0));
}

}  // namespace
}  // namespace layercast::wire
