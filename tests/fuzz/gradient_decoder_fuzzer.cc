// Fuzzes the shard's gradient decoder (GradientDecoder, which a PushGradients
// stream feeds every chunk a worker sends) with a layout and a stream of
// serialized GradientChunks drawn from the input. Properties: whatever the
// bytes, it writes only inside the staging slice (AddressSanitizer, with the
// slice exactly its size), each staged element once and in order; it refuses
// only with the codes its header names; and once it fails, the stream is over.
//
// Input: byte 0 picks the shard count (1-4) and this shard's index; then
// three bytes a tensor for 3 tensors (dtype f32/bf16/f16, element count
// high and low); then frames, each a 2-byte little-endian length and that
// many bytes, handed over as gRPC would: a ByteBuffer of three slices, cut
// where the frame's first and last bytes say (so elements straddle slices),
// read by ReadGradientChunk as the shard reads it.

#include <bit>
#include <cstdint>
#include <vector>

#include "tests/fuzz/fuzz_check.h"
#include "wire/gradient_chunks.h"
#include "wire/owned_runs.h"

namespace layercast::fuzz {
namespace {

constexpr float kCanary = -12345.0f;

}  // namespace
}  // namespace layercast::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace layercast;
  using layercast::fuzz::kCanary;
  if (size < 10) return 0;
  size_t at = 0;
  const uint32_t num_shards = 1 + data[at] % 4;
  const uint32_t shard = (data[at++] >> 2) % num_shards;
  std::vector<DType> dtypes;
  std::vector<uint64_t> counts;
  for (int t = 0; t < 3; ++t) {
    dtypes.push_back(static_cast<DType>(1 + data[at] % 3));
    counts.push_back((uint64_t{data[at + 1]} << 8 | data[at + 2]) % 2048);
    at += 3;
  }
  const absl::StatusOr<AssembledLayout> layout = AssembledLayout::FromDTypes(dtypes, counts);
  FUZZ_CHECK(layout.ok(), "a small layout was refused: %s", layout.status().ToString().c_str());
  std::vector<TensorElementRange> whole;
  for (uint32_t t = 0; t < 3; ++t) whole.push_back({t, ElementRange{0, counts[t]}});
  const std::vector<TensorElementRange> owned = wire::OwnedRuns(*layout, whole, shard, num_shards);
  uint64_t owned_count = 0;
  for (const TensorElementRange& run : owned) owned_count += run.elements.size();
  std::vector<float> staging(owned_count, kCanary);
  wire::GradientDecoder decoder(*layout, owned, staging);

  uint64_t accepted = 0;
  while (at + 2 <= size) {
    const size_t length = std::min<size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
    at += 2;
    // Three slices, any of them empty: an element may span all three.
    const size_t first = length == 0 ? 0 : data[at] % (length + 1);
    const size_t second = first + (length == 0 ? 0 : data[at + length - 1] % (length - first + 1));
    // Static (referencing the input): gRPC merges small copied slices.
    grpc::Slice pieces[] = {
        grpc::Slice(data + at, first, grpc::Slice::STATIC_SLICE),
        grpc::Slice(data + at + first, second - first, grpc::Slice::STATIC_SLICE),
        grpc::Slice(data + at + second, length - second, grpc::Slice::STATIC_SLICE)};
    grpc::ByteBuffer encoded(pieces, 3);
    at += length;
    const absl::StatusOr<wire::GradientChunkView> chunk = wire::ReadGradientChunk(encoded);
    if (!chunk.ok()) {
      FUZZ_CHECK(chunk.status().code() == absl::StatusCode::kInvalidArgument,
                 "an unreadable chunk refused with %s", chunk.status().ToString().c_str());
      break;  // the server ends the stream
    }
    const absl::Status status = decoder.Accept(*chunk);
    if (!status.ok()) {
      FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument ||
                     status.code() == absl::StatusCode::kFailedPrecondition ||
                     status.code() == absl::StatusCode::kDataLoss,
                 "refused with %s", status.ToString().c_str());
      break;  // the server ends the stream at the first error
    }
    accepted += chunk->data_bytes / DTypeSize(static_cast<DType>(chunk->dtype));
  }
  FUZZ_CHECK(accepted <= owned_count, "accepted %llu elements of %llu owned",
             static_cast<unsigned long long>(accepted),
             static_cast<unsigned long long>(owned_count));
  for (uint64_t i = accepted; i < owned_count; ++i) {
    FUZZ_CHECK(std::bit_cast<uint32_t>(staging[i]) == std::bit_cast<uint32_t>(kCanary),
               "staging element %llu beyond the %llu accepted was written",
               static_cast<unsigned long long>(i), static_cast<unsigned long long>(accepted));
  }
  FUZZ_CHECK(!decoder.done() || accepted == owned_count, "done after %llu of %llu elements",
             static_cast<unsigned long long>(accepted),
             static_cast<unsigned long long>(owned_count));
  return 0;
}
