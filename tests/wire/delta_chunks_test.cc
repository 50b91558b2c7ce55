// Delta chunks alone: what is encoded applies back exactly, in either form
// of the changed positions (a bitmap, or gaps for a reader that takes
// them, whichever is smaller), and a chunk whose positions, values or
// checksum do not hold is refused writing nothing; an 8-bit float span's
// changed block scales travel apart from its changed codes; known byte
// strings pin the gaps and the bitmap, for the elements and the scales.

#include "wire/delta_chunks.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"

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

// `span` bfloat16 elements, about `share` of them changed; with `in`, only
// those in [in->first, in->second).
Example MakeExample(uint64_t span, double share,
                    std::optional<std::pair<uint64_t, uint64_t>> in = std::nullopt) {
  std::mt19937 random(static_cast<uint32_t>(span));
  std::bernoulli_distribution pick(share);
  Example example{std::vector<uint8_t>(span * 2), {}, std::vector<uint64_t>((span + 63) / 64)};
  for (uint8_t& byte : example.old_values) byte = static_cast<uint8_t>(random());
  example.new_values = example.old_values;
  for (uint64_t i = 0; i < span; ++i) {
    if (!pick(random) || (in && (i < in->first || i >= in->second))) continue;
    example.new_values[2 * i] ^= 1;
    example.changed[i / 64] |= uint64_t{1} << (i % 64);
    ++example.count;
  }
  return example;
}

// Applies `chunk` to a copy of `old_values`, expecting DATA_LOSS and nothing
// written; its message.
std::string RefusedWritingNothing(const layercast::v1::LayerChunk& chunk,
                                  const std::vector<uint8_t>& old_values, const std::string& why) {
  std::vector<uint8_t> copy = old_values;
  absl::StatusOr<uint64_t> applied = ApplyDeltaChunk(chunk, 2, copy);
  EXPECT_EQ(applied.status().code(), absl::StatusCode::kDataLoss) << why;
  EXPECT_EQ(copy, old_values) << why << ": something was written";
  return std::string(applied.status().message());
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
  const auto refused = [&](const layercast::v1::LayerChunk& chunk, const std::string& why) {
    return RefusedWritingNothing(chunk, example.old_values, why);
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

// The shard's chunk size in bf16 elements: 1 MiB.
constexpr uint64_t kSpan = 1 << 19;

TEST(DeltaChunksTest, GapsWhereSmallerTheBitmapElseAndBothApplyExactly) {
  const uint64_t bitmap = kSpan / 8;
  for (const double share : {0.0, 0.001, 0.01, 0.1, 0.9}) {
    for (const auto& [where, range] :
         std::vector<std::pair<std::string, std::pair<uint64_t, uint64_t>>>{
             {"everywhere", {0, kSpan}},
             {"at the start", {0, kSpan / 16}},
             {"in the middle", {kSpan / 2 - kSpan / 32, kSpan / 2 + kSpan / 32}},
             {"at the end", {kSpan - kSpan / 16, kSpan}}}) {
      // A sixteenth of the span changes at 16x the share: the same count.
      const double local = range.second - range.first == kSpan ? share : std::min(1.0, share * 16);
      Example example = MakeExample(kSpan, local, range);
      const DeltaSpan span{.span_elements = kSpan, .version = 2, .base_version = 1};
      DeltaSpan gaps_allowed = span;
      gaps_allowed.gaps_allowed = true;
      const grpc::Slice as_bitmap = EncodeDeltaChunk(span, example.new_values, 2, example.changed);
      const grpc::Slice adaptive =
          EncodeDeltaChunk(gaps_allowed, example.new_values, 2, example.changed);
      const layercast::v1::LayerChunk chunk = Parse(adaptive);
      // The gaps' size, counted here the plain way: a varint per changed
      // element, 7 bits a byte.
      uint64_t gap_bytes = 0;
      for (uint64_t i = 0, next = 0; i < kSpan; ++i) {
        if ((example.changed[i / 64] >> (i % 64) & 1) == 0) continue;
        for (uint64_t gap = i - next;; gap >>= 7) {
          ++gap_bytes;
          if (gap < 0x80) break;
        }
        next = i + 1;
      }
      const std::string label = absl::StrCat(share, " changed ", where);
      EXPECT_EQ(chunk.changed().empty(), gap_bytes < bitmap) << label << ": the smaller form";
      if (chunk.changed().empty()) {
        EXPECT_EQ(chunk.changed_gaps().size(), gap_bytes) << label;
      }
      EXPECT_LE(adaptive.size(), as_bitmap.size()) << label;
      if (share <= 0.01) {
        EXPECT_TRUE(chunk.changed().empty()) << label << ": few changes, gaps";
      }
      if (share == 0.9 && where == "everywhere") {
        EXPECT_FALSE(chunk.changed().empty()) << label << ": most changed, the bitmap";
      }
      for (const grpc::Slice* slice : {&as_bitmap, &adaptive}) {
        std::vector<uint8_t> copy = example.old_values;
        absl::StatusOr<uint64_t> applied = ApplyDeltaChunk(Parse(*slice), 2, copy);
        ASSERT_TRUE(applied.ok()) << label << ": " << applied.status();
        EXPECT_EQ(*applied, example.count) << label;
        EXPECT_TRUE(copy == example.new_values) << label;
      }
    }
  }
}

TEST(DeltaChunksTest, RefusesBrokenGapsWritingNothing) {
  Example example = MakeExample(1000, 0.01);
  example.new_values[2 * 999] ^= 1;  // the last element too
  example.changed[999 / 64] |= uint64_t{1} << (999 % 64);
  ++example.count;
  const layercast::v1::LayerChunk good = Parse(EncodeDeltaChunk(
      {.span_elements = 1000, .version = 1, .base_version = 0, .gaps_allowed = true},
      example.new_values, 2, example.changed));
  ASSERT_TRUE(good.changed().empty()) << "coded as gaps";
  ASSERT_FALSE(good.changed_gaps().empty());
  const auto refused = [&](const layercast::v1::LayerChunk& chunk, const std::string& why) {
    return RefusedWritingNothing(chunk, example.old_values, why);
  };
  layercast::v1::LayerChunk chunk = good;
  chunk.mutable_changed_gaps()->push_back(static_cast<char>(0x80));
  EXPECT_THAT(refused(chunk, "a varint cut short"), HasSubstr("inside a varint"));
  chunk = good;
  chunk.mutable_changed_gaps()->push_back(0);  // element 1000 of 1000
  EXPECT_THAT(refused(chunk, "a gap past the span"), HasSubstr("past its span"));
  chunk = good;
  *chunk.mutable_changed_gaps() = std::string(10, static_cast<char>(0xff)) + '\x01';
  EXPECT_THAT(refused(chunk, "a varint over 64 bits"), HasSubstr("over 64 bits"));
  chunk = good;
  chunk.mutable_data()->resize(chunk.data().size() - 2);
  EXPECT_THAT(refused(chunk, "one value fewer"), HasSubstr("bytes of values"));
  chunk = good;
  (*chunk.mutable_changed_gaps())[0] ^= 1;
  EXPECT_THAT(refused(chunk, "a moved position"), HasSubstr("CRC-32C"));
  chunk = good;
  chunk.set_changed(std::string(125, '\0'));
  EXPECT_THAT(refused(chunk, "both forms"), HasSubstr("bytes of gaps"));
}

// Known answers, worked by hand from shard.proto's definition of the
// positions (not from the encoder): each gap an unsigned LEB128 varint, low
// 7 bits first, 0x80 on every byte but the last; the first gap the index in
// the span, each next the index minus the previous index minus 1. They pin
// the format: an encoder and a decoder that changed it together would still
// round-trip, and would fail here.
constexpr uint64_t kGapSpan = 40000;  // a 5000-byte bitmap
// Changed elements 5, 6, 134, 263, 564, 16948 and 33333: gaps 5, 0, 127,
// 128, 300, 16383 and 16384, every varint length from one to three bytes.
constexpr uint64_t kGapPositions[] = {5, 6, 134, 263, 564, 16948, 33333};
const std::string kGapBytes("\x05\x00\x7f\x80\x01\xac\x02\xff\x7f\x80\x80\x01", 12);
// Their values, bfloat16 little-endian, packed in element order.
const std::string kGapData("\x01\x40\x02\x40\x03\x40\x04\x40\x05\x40\x06\x40\x07\x40", 14);

std::string Bytes(std::span<const uint8_t> bytes) { return {bytes.begin(), bytes.end()}; }

TEST(DeltaChunksTest, GapsAreTheKnownBytes) {
  std::vector<uint8_t> values(kGapSpan * 2);
  std::vector<uint64_t> changed((kGapSpan + 63) / 64);
  uint8_t k = 0;
  for (const uint64_t i : kGapPositions) {
    values[2 * i] = ++k;
    values[2 * i + 1] = 0x40;
    changed[i / 64] |= uint64_t{1} << (i % 64);
  }
  const layercast::v1::LayerChunk chunk = Parse(EncodeDeltaChunk(
      {.span_elements = kGapSpan, .version = 2, .base_version = 1, .gaps_allowed = true}, values, 2,
      changed));
  EXPECT_EQ(chunk.changed_gaps(), kGapBytes);
  EXPECT_TRUE(chunk.changed().empty());
  EXPECT_EQ(chunk.data(), kGapData);
  // CRC-32C over the data, then the positions.
  EXPECT_EQ(chunk.crc32c(),
            Crc32c(kGapBytes.data(), kGapBytes.size(), Crc32c(kGapData.data(), kGapData.size())));
}

TEST(DeltaChunksTest, KnownGapsApplyToTheKnownPositions) {
  layercast::v1::LayerChunk chunk;
  chunk.set_element_offset(100);
  chunk.set_span_elements(kGapSpan);
  chunk.set_version(2);
  chunk.set_base_version(1);
  chunk.set_data(kGapData);
  chunk.set_changed_gaps(kGapBytes);
  chunk.set_crc32c(
      Crc32c(kGapBytes.data(), kGapBytes.size(), Crc32c(kGapData.data(), kGapData.size())));
  std::vector<uint8_t> values(kGapSpan * 2);
  absl::StatusOr<uint64_t> applied = ApplyDeltaChunk(chunk, 2, values);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(*applied, 7u);
  std::vector<uint8_t> expected(kGapSpan * 2);
  uint8_t k = 0;
  for (const uint64_t i : kGapPositions) {
    expected[2 * i] = ++k;
    expected[2 * i + 1] = 0x40;
  }
  EXPECT_TRUE(values == expected);
}

// The bitmap: bit i of byte i / 8, least significant first. Elements 0, 9
// and 19 of 20: 0x01, 0x02 (bit 1), 0x08 (bit 3). Their gaps (0, 8, 9)
// would take 3 bytes too, not fewer, so a reader that takes gaps gets the
// bitmap as well.
TEST(DeltaChunksTest, TheBitmapIsTheKnownBytes) {
  std::vector<uint8_t> values(20 * 2);
  std::vector<uint64_t> changed = {uint64_t{1} << 0 | uint64_t{1} << 9 | uint64_t{1} << 19};
  for (const bool gaps : {false, true}) {
    const layercast::v1::LayerChunk chunk = Parse(EncodeDeltaChunk(
        {.span_elements = 20, .version = 2, .base_version = 1, .gaps_allowed = gaps}, values, 2,
        changed));
    EXPECT_EQ(chunk.changed(), std::string("\x01\x02\x08", 3)) << "gaps allowed " << gaps;
    EXPECT_TRUE(chunk.changed_gaps().empty()) << "gaps allowed " << gaps;
  }
}

// An 8-bit float span of 9600 codes in 300 blocks (a 38-byte bitmap of
// blocks): code 9599 changed (gap 9599: 0xff 0x4a) and the scales of blocks
// 2, 3, 133 and 270 (gaps 2, 0, 129, 136: 0x02 0x00 0x81 0x01 0x88 0x01).
constexpr uint64_t kFp8Codes = 9600, kFp8Blocks = 300;
const std::string kFp8CodeGaps("\xff\x4a", 2);
const std::string kFp8Code("\x2a", 1);
const std::string kFp8ScaleGaps("\x02\x00\x81\x01\x88\x01", 6);
// Block b's new scale: the bytes b & 0xff, b >> 8, 0x80, 0x3f.
const std::string kFp8Scales("\x02\x00\x80\x3f\x03\x00\x80\x3f\x85\x00\x80\x3f\x0e\x01\x80\x3f",
                             16);
constexpr uint64_t kFp8ChangedBlocks[] = {2, 3, 133, 270};

TEST(DeltaChunksTest, Fp8ScaleGapsAreTheKnownBytes) {
  std::vector<uint8_t> codes(kFp8Codes);
  codes[9599] = 0x2a;
  std::vector<uint64_t> codes_changed((kFp8Codes + 63) / 64);
  codes_changed[9599 / 64] |= uint64_t{1} << (9599 % 64);
  std::vector<uint8_t> scales(kFp8Blocks * 4);
  std::vector<uint64_t> scales_changed((kFp8Blocks + 63) / 64);
  for (const uint64_t b : kFp8ChangedBlocks) {
    scales[4 * b] = static_cast<uint8_t>(b & 0xff);
    scales[4 * b + 1] = static_cast<uint8_t>(b >> 8);
    scales[4 * b + 2] = 0x80;
    scales[4 * b + 3] = 0x3f;
    scales_changed[b / 64] |= uint64_t{1} << (b % 64);
  }
  const DeltaScales delta_scales{scales, scales_changed};
  const layercast::v1::LayerChunk chunk = Parse(EncodeDeltaChunk(
      {.span_elements = kFp8Codes, .version = 2, .base_version = 1, .gaps_allowed = true}, codes, 1,
      codes_changed, &delta_scales));
  EXPECT_EQ(chunk.changed_gaps(), kFp8CodeGaps);
  EXPECT_TRUE(chunk.changed().empty());
  EXPECT_EQ(chunk.data(), kFp8Code);
  EXPECT_EQ(chunk.scales_changed_gaps(), kFp8ScaleGaps);
  EXPECT_TRUE(chunk.scales_changed().empty());
  EXPECT_EQ(chunk.scales(), kFp8Scales);
  // CRC-32C over the codes, their positions, the scales, their positions.
  uint32_t crc = Crc32c(kFp8Code.data(), kFp8Code.size());
  crc = Crc32c(kFp8CodeGaps.data(), kFp8CodeGaps.size(), crc);
  crc = Crc32c(kFp8Scales.data(), kFp8Scales.size(), crc);
  EXPECT_EQ(chunk.crc32c(), Crc32c(kFp8ScaleGaps.data(), kFp8ScaleGaps.size(), crc));
}

TEST(DeltaChunksTest, KnownFp8ScaleGapsApplyToTheKnownBlocks) {
  layercast::v1::LayerChunk chunk;
  chunk.set_span_elements(kFp8Codes);
  chunk.set_version(2);
  chunk.set_base_version(1);
  chunk.set_data(kFp8Code);
  chunk.set_changed_gaps(kFp8CodeGaps);
  chunk.set_scales(kFp8Scales);
  chunk.set_scales_changed_gaps(kFp8ScaleGaps);
  uint32_t crc = Crc32c(kFp8Code.data(), kFp8Code.size());
  crc = Crc32c(kFp8CodeGaps.data(), kFp8CodeGaps.size(), crc);
  crc = Crc32c(kFp8Scales.data(), kFp8Scales.size(), crc);
  chunk.set_crc32c(Crc32c(kFp8ScaleGaps.data(), kFp8ScaleGaps.size(), crc));
  std::vector<uint8_t> codes(kFp8Codes), scales(kFp8Blocks * 4);
  absl::StatusOr<uint64_t> applied = ApplyDeltaChunk(chunk, 1, codes, scales);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(*applied, 1u + 4u) << "one code and four scales";
  std::vector<uint8_t> expected_codes(kFp8Codes), expected_scales(kFp8Blocks * 4);
  expected_codes[9599] = 0x2a;
  for (size_t k = 0; k < 4; ++k) {
    std::memcpy(&expected_scales[4 * kFp8ChangedBlocks[k]], kFp8Scales.data() + 4 * k, 4);
  }
  EXPECT_TRUE(codes == expected_codes);
  EXPECT_EQ(Bytes(scales), Bytes(expected_scales));
}

// An 8-bit float span: 1000 codes in blocks of 32, so 32 block scales.
struct Fp8Example {
  std::vector<uint8_t> old_codes, new_codes, old_scales, new_scales;
  std::vector<uint64_t> codes_changed, scales_changed;
  uint64_t codes = 0, scales = 0;  // how many changed
};

Fp8Example MakeFp8Example(double code_share, double scale_share) {
  constexpr uint64_t kCodes = 1000, kBlocks = 32;
  std::mt19937 random(11);
  std::bernoulli_distribution code(code_share), scale(scale_share);
  Fp8Example example;
  example.old_codes.resize(kCodes);
  example.old_scales.resize(kBlocks * 4);
  for (uint8_t& byte : example.old_codes) byte = static_cast<uint8_t>(random());
  for (uint8_t& byte : example.old_scales) byte = static_cast<uint8_t>(random());
  example.new_codes = example.old_codes;
  example.new_scales = example.old_scales;
  example.codes_changed.assign((kCodes + 63) / 64, 0);
  example.scales_changed.assign(1, 0);
  for (uint64_t i = 0; i < kCodes; ++i) {
    if (!code(random)) continue;
    example.new_codes[i] ^= 0x10;
    example.codes_changed[i / 64] |= uint64_t{1} << (i % 64);
    ++example.codes;
  }
  for (uint64_t b = 0; b < kBlocks; ++b) {
    if (!scale(random)) continue;
    example.new_scales[4 * b + 3] ^= 1;  // the exponent: the scale doubles or halves
    example.scales_changed[0] |= uint64_t{1} << b;
    ++example.scales;
  }
  return example;
}

// A block scale that moves without moving a code costs its 4 bytes and no
// code; after an optimizer step, where every scale moves, the scales go as a
// bitmap of 4 bytes.
TEST(DeltaChunksTest, Fp8SpansCarryTheChangedScalesApartFromTheChangedCodes) {
  for (const auto& [codes, scales] : std::vector<std::pair<double, double>>{
           {0.0, 0.0}, {0.0, 0.1}, {0.03, 0.2}, {0.05, 1.0}, {0.5, 1.0}}) {
    const Fp8Example example = MakeFp8Example(codes, scales);
    for (const bool gaps : {false, true}) {
      const std::string label =
          absl::StrCat(codes, " of the codes and ", scales, " of the scales changed, gaps ", gaps);
      const DeltaScales delta_scales{example.new_scales, example.scales_changed};
      const grpc::Slice slice = EncodeDeltaChunk(
          {.span_elements = 1000, .version = 2, .base_version = 1, .gaps_allowed = gaps},
          example.new_codes, 1, example.codes_changed, &delta_scales);
      const layercast::v1::LayerChunk chunk = Parse(slice);
      EXPECT_EQ(chunk.data().size(), example.codes) << label;
      EXPECT_EQ(chunk.scales().size(), 4 * example.scales) << label;
      EXPECT_TRUE(chunk.scales_changed().empty() || chunk.scales_changed_gaps().empty())
          << label << ": one form";
      if (!gaps) {
        EXPECT_EQ(chunk.scales_changed().size(), 4u) << label;
      }
      // The values, their positions (at most a bitmap each) and a header.
      EXPECT_LE(slice.size(), example.codes + 4 * example.scales + 125 + 4 + 48) << label;
      if (scales == 1.0) {
        EXPECT_EQ(chunk.scales_changed().size(), 4u) << label;
      }
      std::vector<uint8_t> codes_copy = example.old_codes, scales_copy = example.old_scales;
      absl::StatusOr<uint64_t> applied = ApplyDeltaChunk(chunk, 1, codes_copy, scales_copy);
      ASSERT_TRUE(applied.ok()) << label << ": " << applied.status();
      EXPECT_EQ(*applied, example.codes + example.scales) << label << ": scales count too";
      EXPECT_EQ(codes_copy, example.new_codes) << label;
      EXPECT_EQ(scales_copy, example.new_scales) << label;
      // Again: nothing more changes.
      ASSERT_TRUE(ApplyDeltaChunk(chunk, 1, codes_copy, scales_copy).ok());
      EXPECT_EQ(codes_copy, example.new_codes) << label;
      EXPECT_EQ(scales_copy, example.new_scales) << label;
    }
  }
}

TEST(DeltaChunksTest, RefusesBrokenFp8ScalesWritingNothing) {
  const Fp8Example example = MakeFp8Example(0.03, 0.2);
  const DeltaScales delta_scales{example.new_scales, example.scales_changed};
  const layercast::v1::LayerChunk good =
      Parse(EncodeDeltaChunk({.span_elements = 1000, .version = 2, .base_version = 1},
                             example.new_codes, 1, example.codes_changed, &delta_scales));
  ASSERT_FALSE(good.scales_changed().empty());
  const auto refused = [&](const layercast::v1::LayerChunk& chunk, std::span<uint8_t> scales,
                           const std::string& why) {
    std::vector<uint8_t> codes = example.old_codes;
    std::vector<uint8_t> before(scales.begin(), scales.end());
    absl::StatusOr<uint64_t> applied = ApplyDeltaChunk(chunk, 1, codes, scales);
    EXPECT_EQ(applied.status().code(), absl::StatusCode::kDataLoss) << why;
    EXPECT_EQ(codes, example.old_codes) << why << ": a code was written";
    EXPECT_TRUE(std::equal(scales.begin(), scales.end(), before.begin())) << why;
    return std::string(applied.status().message());
  };
  std::vector<uint8_t> scales = example.old_scales;
  EXPECT_THAT(refused(good, {}, "scales for a 16-bit tensor"), HasSubstr("not in an 8-bit float"));
  layercast::v1::LayerChunk chunk = good;
  chunk.mutable_scales_changed()->pop_back();
  EXPECT_THAT(refused(chunk, scales, "short scale bitmap"), HasSubstr("bitmap"));
  chunk = good;
  chunk.mutable_scales()->resize(chunk.scales().size() - 4);
  EXPECT_THAT(refused(chunk, scales, "one scale fewer"), HasSubstr("bytes of values"));
  chunk = good;
  (*chunk.mutable_scales())[0] ^= 1;
  EXPECT_THAT(refused(chunk, scales, "corrupted scale"), HasSubstr("CRC-32C"));
  chunk = good;
  chunk.set_scales_changed_gaps(std::string(1, '\0'));
  EXPECT_THAT(refused(chunk, scales, "both forms"), HasSubstr("bytes of gaps"));
  std::vector<uint8_t> too_few(4 * 24);
  EXPECT_THAT(refused(good, too_few, "24 blocks' scales"), HasSubstr("bitmap"));
}

}  // namespace
}  // namespace layercast::wire
