#include "wire/delta_chunks.h"

#include <bit>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"

namespace layercast::wire {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the bitmap's bytes are the words' bytes in memory order");

uint64_t BitmapBytes(uint64_t elements) { return (elements + 7) / 8; }

}  // namespace

grpc::Slice EncodeDeltaChunk(const DeltaSpan& span, std::span<const uint8_t> values,
                             size_t element_size, std::span<const uint64_t> changed) {
  layercast::v1::LayerChunk chunk;
  chunk.set_tensor(span.tensor);
  chunk.set_element_offset(span.element_offset);
  chunk.set_version(span.version);
  chunk.set_base_version(span.base_version);
  chunk.set_span_elements(span.span_elements);
  uint64_t count = 0;
  for (const uint64_t word : changed) count += std::popcount(word);
  std::string* data = chunk.mutable_data();
  data->resize(count * element_size);
  char* out = data->data();
  for (uint64_t w = 0; w < changed.size(); ++w) {
    for (uint64_t word = changed[w]; word != 0; word &= word - 1) {
      const uint64_t i = w * 64 + std::countr_zero(word);
      std::memcpy(out, values.data() + i * element_size, element_size);
      out += element_size;
    }
  }
  chunk.set_changed(reinterpret_cast<const char*>(changed.data()), BitmapBytes(span.span_elements));
  chunk.set_crc32c(
      Crc32c(chunk.changed().data(), chunk.changed().size(), Crc32c(data->data(), data->size())));
  const size_t bytes = chunk.ByteSizeLong();
  auto* message = static_cast<uint8_t*>(std::malloc(bytes));
  if (message == nullptr) throw std::bad_alloc();
  chunk.SerializeWithCachedSizesToArray(message);
  return grpc::Slice(message, bytes, std::free);
}

absl::StatusOr<uint64_t> ApplyDeltaChunk(const layercast::v1::LayerChunk& chunk,
                                         size_t element_size, std::span<uint8_t> destination) {
  const uint64_t span = chunk.span_elements();
  const std::string& changed = chunk.changed();
  if (changed.size() != BitmapBytes(span) || destination.size() != span * element_size) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk of ", span, " elements with a ",
                                            changed.size(), "-byte bitmap"));
  }
  uint64_t count = 0;
  for (const char byte : changed) count += std::popcount(static_cast<uint8_t>(byte));
  if (span % 8 != 0 && (static_cast<uint8_t>(changed.back()) >> (span % 8)) != 0) {
    return absl::DataLossError("sent a delta chunk whose bitmap marks elements past its span");
  }
  if (chunk.data().size() != count * element_size) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk marking ", count,
                                            " changed elements with ", chunk.data().size(),
                                            " bytes of values"));
  }
  if (chunk.has_crc32c() &&
      Crc32c(changed.data(), changed.size(), Crc32c(chunk.data().data(), chunk.data().size())) !=
          chunk.crc32c()) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk of tensor ", chunk.tensor(),
                                            " from element ", chunk.element_offset(),
                                            " with a CRC-32C that does not match its data"));
  }
  const char* in = chunk.data().data();
  for (uint64_t b = 0; b < changed.size(); ++b) {
    for (auto byte = static_cast<uint8_t>(changed[b]); byte != 0; byte &= byte - 1) {
      const uint64_t i = b * 8 + std::countr_zero(byte);
      std::memcpy(destination.data() + i * element_size, in, element_size);
      in += element_size;
    }
  }
  return count;
}

}  // namespace layercast::wire
