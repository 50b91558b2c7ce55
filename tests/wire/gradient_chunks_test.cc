// A worker's gradient cut for each shard and checked and widened by it: the
// round trip is exact, and every way a stream can break the contract is
// refused with its code.

#include "wire/gradient_chunks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/escaping.h"
#include "core/cast.h"
#include "wire/owned_runs.h"

namespace layercast::wire {
namespace {

using ::testing::HasSubstr;

AssembledLayout TestLayout() {
  return *AssembledLayout::FromDTypes({DType::kBFloat16, DType::kFloat32, DType::kFloat16},
                                      {1000, 37, 515});
}

// A gradient in the assembled layout: random finite values in each tensor's
// compute dtype.
std::vector<uint8_t> TestGradient(const AssembledLayout& layout) {
  std::vector<uint8_t> buffer(layout.total_bytes(), 0);
  std::mt19937 random(7);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  for (const AssembledTensor& t : layout.tensors()) {
    std::vector<float> values(t.num_elements);
    for (float& v : values) v = normal(random);
    EXPECT_TRUE(CastFromF32(values.data(), buffer.data() + t.byte_offset, values.size(),
                            t.compute_dtype, Fp16Overflow::kError)
                    .ok());
  }
  return buffer;
}

std::vector<TensorElementRange> Owned(const AssembledLayout& layout, uint32_t shard, uint32_t n) {
  std::vector<TensorElementRange> whole;
  for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
    whole.push_back({t, ElementRange{0, layout.tensors()[t].num_elements}});
  }
  return OwnedRuns(layout, whole, shard, n);
}

uint64_t Count(const std::vector<TensorElementRange>& runs) {
  uint64_t n = 0;
  for (const TensorElementRange& run : runs) n += run.elements.size();
  return n;
}

// How a test hands a chunk's bytes over in slices, as gRPC may: slices of
// growing odd sizes (elements straddle two slices), or single bytes with an
// empty slice after each (an fp32 element spans four slices and three empty
// ones).
enum class Slicing { kGrowing, kBytes };

// Feeds `chunk` to `decoder` encoded and cut into slices.
absl::Status Accept(GradientDecoder& decoder, const layercast::v1::GradientChunk& chunk,
                    Slicing slicing = Slicing::kGrowing) {
  const std::string encoded = chunk.SerializeAsString();
  std::vector<grpc::Slice> slices;
  for (size_t at = 0, piece = 1; at < encoded.size(); at += piece) {
    piece = std::min(slicing == Slicing::kBytes ? 1 : piece * 3 + 2, encoded.size() - at);
    // Static: gRPC merges small copied slices into one, and would hide the
    // slicing under test.
    slices.emplace_back(encoded.data() + at, piece, grpc::Slice::STATIC_SLICE);
    if (slicing == Slicing::kBytes) slices.emplace_back();
  }
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  absl::StatusOr<GradientChunkView> view = ReadGradientChunk(buffer);
  if (!view.ok()) return view.status();
  return decoder.Accept(*view);
}

std::vector<layercast::v1::GradientChunk> Cut(const AssembledLayout& layout,
                                              const std::vector<uint8_t>& gradient, uint32_t shard,
                                              uint32_t n, uint64_t chunk_bytes) {
  GradientChunker chunker(layout, gradient, {5, 1, 3, shard, n}, chunk_bytes);
  std::vector<layercast::v1::GradientChunk> chunks;
  layercast::v1::GradientChunk chunk;
  while (chunker.Next(&chunk)) chunks.push_back(chunk);
  return chunks;
}

TEST(GradientChunksTest, EveryShardReceivesExactlyItsElementsWidenedExactly) {
  const AssembledLayout layout = TestLayout();
  const std::vector<uint8_t> gradient = TestGradient(layout);
  for (const auto& [n, slicing] :
       {std::pair{1u, Slicing::kGrowing}, {3u, Slicing::kBytes}, {8u, Slicing::kGrowing}}) {
    for (uint32_t shard = 0; shard < n; ++shard) {
      const std::vector<TensorElementRange> owned = Owned(layout, shard, n);
      std::vector<float> staging(Count(owned), -1.0f);
      GradientDecoder decoder(layout, owned, staging);
      for (const auto& chunk : Cut(layout, gradient, shard, n, 64)) {
        ASSERT_LE(chunk.data().size(), 64u);
        EXPECT_EQ(chunk.step(), 5u);
        EXPECT_EQ(chunk.worker(), 1u);
        EXPECT_EQ(chunk.layer(), 3u);
        ASSERT_TRUE(Accept(decoder, chunk, slicing).ok()) << decoder.Due();
      }
      ASSERT_TRUE(decoder.done()) << decoder.Due();
      // What the shard staged is the worker's values, widened exactly.
      uint64_t at = 0;
      for (const TensorElementRange& run : owned) {
        const AssembledTensor& t = layout.tensors()[run.tensor];
        std::vector<float> expected(run.elements.size());
        CastToF32(gradient.data() + t.byte_offset + run.elements.begin * DTypeSize(t.compute_dtype),
                  t.compute_dtype, expected.data(), expected.size());
        ASSERT_EQ(std::memcmp(expected.data(), staging.data() + at, expected.size() * 4), 0)
            << "shard " << shard << " of " << n << ", tensor " << run.tensor;
        at += expected.size();
      }
    }
  }
}

// A shard that owns no element of a layer (a 1-element tensor, 2 shards: shard
// 0's share is empty) still takes the push, as one chunk without data, so
// that its step counts it; a second such chunk, or one with data, is refused.
TEST(GradientChunksTest, AShardOwningNothingTakesOneChunkWithoutData) {
  const AssembledLayout layout = *AssembledLayout::FromDTypes({DType::kBFloat16}, {1});
  const std::vector<uint8_t> gradient(layout.total_bytes(), 0);
  const std::vector<TensorElementRange> owned = Owned(layout, 0, 2);
  ASSERT_EQ(Count(owned), 0u);
  const std::vector<layercast::v1::GradientChunk> chunks = Cut(layout, gradient, 0, 2, 64);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_TRUE(chunks[0].data().empty());
  EXPECT_EQ(chunks[0].layer(), 3u);
  std::vector<float> staging;
  GradientDecoder decoder(layout, owned, staging);
  EXPECT_FALSE(decoder.done()) << "nothing arrived yet";
  ASSERT_TRUE(Accept(decoder, chunks[0]).ok());
  EXPECT_TRUE(decoder.done());
  EXPECT_EQ(Accept(decoder, chunks[0]).code(), absl::StatusCode::kInvalidArgument);
  GradientDecoder other(layout, owned, staging);
  layercast::v1::GradientChunk with_data = chunks[0];
  with_data.set_data(std::string(2, '\0'));
  EXPECT_EQ(Accept(other, with_data).code(), absl::StatusCode::kInvalidArgument);
}

TEST(GradientChunksTest, Float32IsAcceptedForAnyTensor) {
  const AssembledLayout layout = TestLayout();
  const std::vector<TensorElementRange> owned = Owned(layout, 0, 2);
  std::vector<float> staging(Count(owned));
  GradientDecoder decoder(layout, owned, staging);
  layercast::v1::GradientChunk chunk;
  chunk.set_tensor(0);
  const std::vector<float> values = {0.25f, -3.5f};
  chunk.set_data(values.data(), sizeof(float) * values.size());
  chunk.set_dtype(layercast::v1::FLOAT32);
  ASSERT_TRUE(Accept(decoder, chunk, Slicing::kBytes).ok());
  EXPECT_EQ(staging[0], 0.25f);
  EXPECT_EQ(staging[1], -3.5f);
}

// Bytes that are not an encoded GradientChunk are INVALID_ARGUMENT, saying
// where they broke.
TEST(GradientChunksTest, BytesThatAreNotAChunkAreRefused) {
  for (const std::string& bytes : {std::string("\x02\x00", 2),  // field 0
                                   std::string("\x32\x05"
                                               "ab"),       // data cut short
                                   std::string("\x08"),     // a varint cut short
                                   std::string("\x0c")}) {  // an end-group tag
    grpc::Slice slice(bytes.data(), bytes.size());
    grpc::ByteBuffer buffer(&slice, 1);
    const absl::StatusOr<GradientChunkView> view = ReadGradientChunk(buffer);
    EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument) << absl::CHexEscape(bytes);
    EXPECT_THAT(std::string(view.status().message()), HasSubstr("at byte"));
  }
}

// Each broken stream is refused with the code FetchLayer would use, and
// staging outside what was accepted stays untouched.
TEST(GradientChunksTest, BrokenStreamsAreRefusedWithTheirCodes) {
  const AssembledLayout layout = TestLayout();
  const std::vector<uint8_t> gradient = TestGradient(layout);
  const std::vector<TensorElementRange> owned = Owned(layout, 1, 3);
  const std::vector<layercast::v1::GradientChunk> good = Cut(layout, gradient, 1, 3, 128);
  ASSERT_GE(good.size(), 4u);
  struct Case {
    const char* what;
    std::function<std::vector<layercast::v1::GradientChunk>()> stream;
    absl::StatusCode code;
    const char* says;
  };
  const auto with = [&](size_t i, std::function<void(layercast::v1::GradientChunk&)> change) {
    std::vector<layercast::v1::GradientChunk> chunks(good.begin(), good.begin() + i + 1);
    change(chunks[i]);
    return chunks;
  };
  const std::vector<Case> cases = {
      {"repeat",
       [&] {
         return std::vector{good[0], good[0]};
       },
       absl::StatusCode::kInvalidArgument, "was due"},
      {"out of order", [&] { return std::vector{good[1]}; }, absl::StatusCode::kInvalidArgument,
       "was due"},
      {"overlap",
       [&] { return with(1, [](auto& c) { c.set_element_offset(c.element_offset() - 1); }); },
       absl::StatusCode::kInvalidArgument, "was due"},
      {"another worker", [&] { return with(1, [](auto& c) { c.set_worker(2); }); },
       absl::StatusCode::kInvalidArgument, "one (step, worker, layer)"},
      {"another step", [&] { return with(2, [](auto& c) { c.set_step(6); }); },
       absl::StatusCode::kInvalidArgument, "one (step, worker, layer)"},
      {"half an element", [&] { return with(0, [](auto& c) { c.mutable_data()->pop_back(); }); },
       absl::StatusCode::kInvalidArgument, "elements of 2 bytes remain"},
      {"empty", [&] { return with(0, [](auto& c) { c.clear_data(); }); },
       absl::StatusCode::kInvalidArgument, "a chunk of 0 bytes"},
      {"wrong dtype", [&] { return with(0, [](auto& c) { c.set_dtype(layercast::v1::FLOAT16); }); },
       absl::StatusCode::kFailedPrecondition, "compute dtype bfloat16 or in FLOAT32"},
      {"no dtype", [&] { return with(0, [](auto& c) { c.clear_dtype(); }); },
       absl::StatusCode::kFailedPrecondition, "DTYPE_UNSPECIFIED"},
      // 257 would narrow to FLOAT32 (1) if taken as a DType unchecked.
      {"unknown dtype",
       [&] {
         return with(0, [](auto& c) { c.set_dtype(static_cast<layercast::v1::DType>(257)); });
       },
       absl::StatusCode::kFailedPrecondition, "came as dtype 257"},
      {"corrupt", [&] { return with(0, [](auto& c) { (*c.mutable_data())[3] ^= 1; }); },
       absl::StatusCode::kDataLoss, "CRC-32C"},
  };
  for (const Case& c : cases) {
    std::vector<float> staging(Count(owned), -7.0f);
    GradientDecoder decoder(layout, owned, staging);
    absl::Status status;
    size_t accepted_floats = 0;
    for (const auto& chunk : c.stream()) {
      status = Accept(decoder, chunk);
      if (!status.ok()) break;
      accepted_floats += chunk.data().size() / DTypeSize(static_cast<DType>(chunk.dtype()));
    }
    EXPECT_EQ(status.code(), c.code) << c.what << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.says)) << c.what;
    for (size_t i = accepted_floats; i < staging.size(); ++i) {
      ASSERT_EQ(staging[i], -7.0f) << c.what << ": staging element " << i << " written";
    }
  }
  // A stream that stops early is simply not done.
  std::vector<float> staging(Count(owned));
  GradientDecoder decoder(layout, owned, staging);
  ASSERT_TRUE(Accept(decoder, good[0]).ok());
  EXPECT_FALSE(decoder.done());
  EXPECT_THAT(decoder.Due(), HasSubstr("tensor 0 from element"));
}

}  // namespace
}  // namespace layercast::wire
