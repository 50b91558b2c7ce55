// Fuzzes the wire module's chunk decoder (ChunkDecoder, which ShardStream feeds
// every frame a shard sends) with a plan and a stream of frames drawn from
// the input. Properties: whatever the bytes, it writes only inside the
// buffer (AddressSanitizer, with the buffer exactly its size) and only inside
// the plan's runs (every byte outside them keeps its canary); it counts a
// chunk only when it lies exactly where the plan says next; and once it
// fails, the stream is over (as ShardStream cancels it).
//
// Input: byte 0 picks the number of runs (1-4); then three bytes a run
// (element size 1/2/4, or 1 with a block scale every 16 elements as an 8-bit
// float's, the scales after the codes; first element; element count); then
// frames, each a 2-byte little-endian length and that many bytes.

#include <cstdint>
#include <cstring>
#include <vector>

#include "tests/fuzz/fuzz_check.h"
#include "wire/chunk_decoder.h"

namespace layercast::fuzz {
namespace {

constexpr uint8_t kCanary = 0xA5;
constexpr uint32_t kFp8Block = 16;

}  // namespace
}  // namespace layercast::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using layercast::ElementRange;
  using layercast::fuzz::kCanary;
  using layercast::fuzz::kFp8Block;
  using layercast::wire::ChunkDecoder;
  if (size < 1) return 0;
  size_t at = 0;
  const size_t num_runs = 1 + data[at++] % 4;
  if (size < at + 3 * num_runs) return 0;
  // Runs of tensors 0..n-1, each tensor 256-aligned after the previous.
  std::vector<ChunkDecoder::Run> runs;
  uint64_t offset = 0;
  for (size_t r = 0; r < num_runs; ++r) {
    const bool fp8 = data[at] % 4 == 3;
    const size_t element_size = fp8 ? 1 : size_t{1} << (data[at] % 4);
    const uint64_t begin = data[at + 1] % 64;
    const uint64_t count = 1 + data[at + 2] % 64;
    at += 3;
    ChunkDecoder::Run run{static_cast<uint32_t>(r), ElementRange{begin, begin + count}, offset,
                          element_size};
    offset += (begin + count) * element_size;
    offset = (offset + 255) / 256 * 256;
    if (fp8) {
      run.block_size = kFp8Block;
      run.scale_offset = offset;
      offset += (begin + count + kFp8Block - 1) / kFp8Block * sizeof(float);
      offset = (offset + 255) / 256 * 256;
    }
    runs.push_back(run);
  }
  std::vector<uint8_t> buffer(offset, kCanary);
  std::vector<bool> planned(offset, false);
  for (const ChunkDecoder::Run& run : runs) {
    for (uint64_t b = run.byte_offset + run.elements.begin * run.element_size;
         b < run.byte_offset + run.elements.end * run.element_size; ++b) {
      planned[b] = true;
    }
    if (run.block_size == 0) continue;
    // The scales of every block the run touches.
    const uint64_t first = run.elements.begin / run.block_size;
    const uint64_t end = (run.elements.end + run.block_size - 1) / run.block_size;
    for (uint64_t b = run.scale_offset + first * sizeof(float);
         b < run.scale_offset + end * sizeof(float); ++b) {
      planned[b] = true;
    }
  }

  ChunkDecoder decoder(runs, buffer);
  uint64_t accepted_bytes = 0;
  while (at + 2 <= size) {
    const size_t length = std::min<size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
    at += 2;
    const grpc::Slice slice(data + at, length);
    at += length;
    grpc::ByteBuffer frame(&slice, 1);
    const size_t run_before = decoder.done() ? runs.size() : decoder.next_run()->tensor;
    const uint64_t element_before = decoder.next_element();
    absl::StatusOr<uint64_t> placed = decoder.Accept(frame);
    if (!placed.ok()) {
      FUZZ_CHECK(placed.status().code() == absl::StatusCode::kDataLoss, "refused with %s",
                 placed.status().ToString().c_str());
      break;  // ShardStream cancels the stream at the first error
    }
    FUZZ_CHECK(run_before < runs.size(), "a chunk was accepted after the plan was done");
    const ChunkDecoder::Run& run = runs[run_before];
    FUZZ_CHECK(*placed > 0 && *placed % run.element_size == 0 &&
                   element_before + *placed / run.element_size <= run.elements.end,
               "accepted %llu bytes for run %zu from element %llu",
               static_cast<unsigned long long>(*placed), run_before,
               static_cast<unsigned long long>(element_before));
    accepted_bytes += *placed;
  }
  uint64_t planned_bytes = 0;
  for (uint64_t b = 0; b < buffer.size(); ++b) {
    planned_bytes += planned[b];
    FUZZ_CHECK(planned[b] || buffer[b] == kCanary, "byte %llu outside the plan was written",
               static_cast<unsigned long long>(b));
  }
  FUZZ_CHECK(accepted_bytes <= planned_bytes, "accepted %llu bytes of a %llu-byte plan",
             static_cast<unsigned long long>(accepted_bytes),
             static_cast<unsigned long long>(planned_bytes));
  return 0;
}
