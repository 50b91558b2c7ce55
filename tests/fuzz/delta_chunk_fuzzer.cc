// Fuzzes the delta chunk's reader (ApplyDeltaChunk, which a worker runs on
// every delta chunk a shard sends) in both forms of the changed positions,
// the bitmap and the LEB128 gaps. Two modes, picked by byte 2:
//
// - decode: a chunk whose positions and values are the input's bytes, its
//   CRC right (or not). Properties: an error writes nothing (every byte of
//   the destination keeps its canary); success writes only inside the
//   destination (AddressSanitizer, the buffer exactly the span's), counts
//   as many elements as it has values, and applying it again changes
//   nothing more.
// - round trip: the input's bytes are a span's changed bitmap and new
//   values; encoded with gaps allowed (the smaller form) and without,
//   both apply back to exactly the new values (and, for 1-byte elements,
//   as 8-bit codes, the changed block scales), and the gaps form is never
//   larger than the bitmap form.
//
// Input: 2 bytes of span (1-4096 elements), 1 byte of mode and element
// size (1, 2 or 4 bytes), 1 byte of position bytes; the rest as said.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/crc32c.h"
#include "tests/fuzz/fuzz_check.h"
#include "wire/delta_chunks.h"

namespace {

constexpr uint8_t kCanary = 0xA5;

layercast::v1::LayerChunk Parse(const grpc::Slice& slice) {
  layercast::v1::LayerChunk chunk;
  FUZZ_CHECK(chunk.ParseFromArray(slice.begin(), static_cast<int>(slice.size())),
             "an encoded chunk does not parse");
  return chunk;
}

void Decode(const uint8_t* data, size_t size, uint64_t span, size_t element_size, bool gaps,
            bool right_crc) {
  if (size < 1) return;
  const size_t positions = std::min<size_t>(data[0], size - 1);
  layercast::v1::LayerChunk chunk;
  chunk.set_span_elements(span);
  const std::string bytes(reinterpret_cast<const char*>(data + 1), positions);
  if (gaps) {
    chunk.set_changed_gaps(bytes);
  } else {
    chunk.set_changed(bytes);
  }
  chunk.set_data(reinterpret_cast<const char*>(data + 1 + positions), size - 1 - positions);
  const uint32_t crc = layercast::Crc32c(
      bytes.data(), bytes.size(), layercast::Crc32c(chunk.data().data(), chunk.data().size()));
  chunk.set_crc32c(right_crc ? crc : crc ^ 1);
  std::vector<uint8_t> destination(span * element_size, kCanary);
  const absl::StatusOr<uint64_t> applied =
      layercast::wire::ApplyDeltaChunk(chunk, element_size, destination);
  if (!applied.ok()) {
    for (const uint8_t byte : destination) {
      FUZZ_CHECK(byte == kCanary, "a refused chunk wrote into the destination: %s",
                 std::string(applied.status().message()).c_str());
    }
    return;
  }
  FUZZ_CHECK(right_crc, "a chunk with a wrong CRC was applied");
  FUZZ_CHECK(*applied * element_size == chunk.data().size(),
             "applied %llu elements from %zu bytes of values",
             static_cast<unsigned long long>(*applied), chunk.data().size());
  const std::vector<uint8_t> once = destination;
  FUZZ_CHECK(layercast::wire::ApplyDeltaChunk(chunk, element_size, destination).ok() &&
                 destination == once,
             "applying a chunk again changed more");
}

void RoundTrip(const uint8_t* data, size_t size, uint64_t span, size_t element_size) {
  const uint64_t bitmap_bytes = (span + 7) / 8;
  if (size < bitmap_bytes) return;
  std::vector<uint64_t> changed((span + 63) / 64, 0);
  std::memcpy(changed.data(), data, bitmap_bytes);
  if (span % 64 != 0) changed.back() &= (uint64_t{1} << (span % 64)) - 1;
  std::vector<uint8_t> values(span * element_size, 0);
  std::memcpy(values.data(), data + bitmap_bytes,
              std::min<size_t>(values.size(), size - bitmap_bytes));
  std::vector<uint8_t> expected(span * element_size, kCanary);
  for (uint64_t i = 0; i < span; ++i) {
    if ((changed[i / 64] >> (i % 64) & 1) != 0) {
      std::memcpy(&expected[i * element_size], &values[i * element_size], element_size);
    }
  }
  // 1-byte elements are 8-bit codes, in blocks of 32: their scales are the
  // values' first bytes again, and changed where the elements' first bits
  // say.
  const bool fp8 = element_size == 1;
  const uint64_t blocks = fp8 ? (span + 31) / 32 : 0;
  std::vector<uint8_t> scales(blocks * 4);
  for (uint64_t i = 0; i < scales.size(); ++i) scales[i] = values[i % values.size()];
  std::vector<uint64_t> scales_changed((blocks + 63) / 64, 0);
  std::vector<uint8_t> expected_scales(blocks * 4, kCanary);
  for (uint64_t b = 0; b < blocks; ++b) {
    if ((changed[b / 64] >> (b % 64) & 1) == 0) continue;
    scales_changed[b / 64] |= uint64_t{1} << (b % 64);
    std::memcpy(&expected_scales[b * 4], &scales[b * 4], 4);
  }
  const layercast::wire::DeltaScales delta_scales{scales, scales_changed};
  uint64_t sizes[2] = {0, 0};
  for (const bool gaps_allowed : {false, true}) {
    const grpc::Slice slice = layercast::wire::EncodeDeltaChunk(
        {.span_elements = span, .version = 2, .base_version = 1, .gaps_allowed = gaps_allowed},
        values, element_size, changed, fp8 ? &delta_scales : nullptr);
    sizes[gaps_allowed] = slice.size();
    std::vector<uint8_t> destination(span * element_size, kCanary);
    std::vector<uint8_t> scale_destination(blocks * 4, kCanary);
    const absl::StatusOr<uint64_t> applied = layercast::wire::ApplyDeltaChunk(
        Parse(slice), element_size, destination, scale_destination);
    FUZZ_CHECK(applied.ok(), "an encoded chunk is refused: %s",
               std::string(applied.status().message()).c_str());
    FUZZ_CHECK(destination == expected, "an encoded chunk (gaps %s) applies to other values",
               gaps_allowed ? "allowed" : "not allowed");
    FUZZ_CHECK(scale_destination == expected_scales,
               "an encoded chunk (gaps %s) applies to other block scales",
               gaps_allowed ? "allowed" : "not allowed");
  }
  FUZZ_CHECK(sizes[1] <= sizes[0],
             "the adaptive form (%llu bytes) is larger than the bitmap's "
             "(%llu)",
             static_cast<unsigned long long>(sizes[1]), static_cast<unsigned long long>(sizes[0]));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const uint64_t span = 1 + ((data[0] | (data[1] << 8)) % 4096);
  const uint8_t mode = data[2];
  const size_t element_size = size_t{1} << (mode % 3);
  switch ((mode / 3) % 4) {
    case 0:
      Decode(data + 3, size - 3, span, element_size, /*gaps=*/true, /*right_crc=*/true);
      break;
    case 1:
      Decode(data + 3, size - 3, span, element_size, /*gaps=*/false, /*right_crc=*/true);
      break;
    case 2:
      Decode(data + 3, size - 3, span, element_size, /*gaps=*/true, /*right_crc=*/false);
      break;
    default:
      RoundTrip(data + 3, size - 3, span, element_size);
  }
  return 0;
}
