#include "wire/delta_chunks.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

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
  const uint64_t bitmap_bytes = BitmapBytes(span.span_elements);
  // Each gap takes at least a byte: past one change in 8 elements the
  // bitmap is smaller, and the gaps are not worth writing.
  const bool try_gaps = span.gaps_allowed && count < bitmap_bytes;
  std::string* gaps = chunk.mutable_changed_gaps();
  if (try_gaps) gaps->reserve(count * 2);
  std::string* data = chunk.mutable_data();
  data->resize(count * element_size);
  char* out = data->data();
  uint64_t next = 0;  // the index the next gap counts from
  for (uint64_t w = 0; w < changed.size(); ++w) {
    for (uint64_t word = changed[w]; word != 0; word &= word - 1) {
      const uint64_t i = w * 64 + std::countr_zero(word);
      std::memcpy(out, values.data() + i * element_size, element_size);
      out += element_size;
      if (try_gaps && gaps->size() < bitmap_bytes) {
        for (uint64_t gap = i - next;; gap >>= 7) {
          if (gap < 0x80) {
            gaps->push_back(static_cast<char>(gap));
            break;
          }
          gaps->push_back(static_cast<char>(0x80 | (gap & 0x7f)));
        }
        next = i + 1;
      }
    }
  }
  if (!try_gaps || gaps->size() >= bitmap_bytes) {
    gaps->clear();
    chunk.set_changed(reinterpret_cast<const char*>(changed.data()), bitmap_bytes);
  }
  const std::string& positions = chunk.changed().empty() ? *gaps : chunk.changed();
  chunk.set_crc32c(Crc32c(positions.data(), positions.size(), Crc32c(data->data(), data->size())));
  const size_t bytes = chunk.ByteSizeLong();
  auto* message = static_cast<uint8_t*>(std::malloc(bytes));
  if (message == nullptr) throw std::bad_alloc();
  chunk.SerializeWithCachedSizesToArray(message);
  return grpc::Slice(message, bytes, std::free);
}

namespace {

// Reads the gap varints of `gaps` into the indices of the changed elements
// of a span of `span` elements; DATA_LOSS for a varint cut short or over 64
// bits, or a position past the span.
absl::Status DecodeGaps(const std::string& gaps, uint64_t span, std::vector<uint64_t>& indices) {
  indices.clear();
  uint64_t next = 0;
  for (size_t at = 0; at < gaps.size();) {
    uint64_t gap = 0;
    for (int shift = 0;; shift += 7) {
      if (at == gaps.size() || shift > 63) {
        return absl::DataLossError("sent a delta chunk whose changed_gaps end inside a varint");
      }
      const auto byte = static_cast<uint8_t>(gaps[at++]);
      if (shift == 63 && byte > 1) {
        return absl::DataLossError("sent a delta chunk with a changed_gaps varint over 64 bits");
      }
      gap |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) break;
    }
    if (gap >= span - std::min(next, span)) {
      return absl::DataLossError(absl::StrCat(
          "sent a delta chunk whose changed_gaps mark an element past its span of ", span));
    }
    indices.push_back(next + gap);
    next += gap + 1;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ApplyDeltaChunk(const layercast::v1::LayerChunk& chunk,
                                         size_t element_size, std::span<uint8_t> destination) {
  const uint64_t span = chunk.span_elements();
  const std::string& changed = chunk.changed();
  const bool bitmap = !changed.empty();
  if ((bitmap && changed.size() != BitmapBytes(span)) ||
      (bitmap && !chunk.changed_gaps().empty()) || destination.size() != span * element_size) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk of ", span, " elements with a ",
                                            changed.size(), "-byte bitmap and ",
                                            chunk.changed_gaps().size(), " bytes of gaps"));
  }
  thread_local std::vector<uint64_t> indices;
  uint64_t count = 0;
  if (bitmap) {
    for (const char byte : changed) count += std::popcount(static_cast<uint8_t>(byte));
    if (span % 8 != 0 && (static_cast<uint8_t>(changed.back()) >> (span % 8)) != 0) {
      return absl::DataLossError("sent a delta chunk whose bitmap marks elements past its span");
    }
  } else {
    if (absl::Status decoded = DecodeGaps(chunk.changed_gaps(), span, indices); !decoded.ok()) {
      return decoded;
    }
    count = indices.size();
  }
  if (chunk.data().size() != count * element_size) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk marking ", count,
                                            " changed elements with ", chunk.data().size(),
                                            " bytes of values"));
  }
  const std::string& positions = bitmap ? changed : chunk.changed_gaps();
  if (chunk.has_crc32c() &&
      Crc32c(positions.data(), positions.size(),
             Crc32c(chunk.data().data(), chunk.data().size())) != chunk.crc32c()) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk of tensor ", chunk.tensor(),
                                            " from element ", chunk.element_offset(),
                                            " with a CRC-32C that does not match its data"));
  }
  const char* in = chunk.data().data();
  if (!bitmap) {
    for (const uint64_t i : indices) {
      std::memcpy(destination.data() + i * element_size, in, element_size);
      in += element_size;
    }
    return count;
  }
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
