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
#include "platform/status_macros.h"

namespace layercast::wire {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the bitmap's bytes are the words' bytes in memory order");

uint64_t BitmapBytes(uint64_t elements) { return (elements + 7) / 8; }

// Packs the values of `values` (`span` items of `size` bytes) that
// `changed` marks into `data`, and their positions into `bitmap`, or into
// `gaps` when `gaps_allowed` and that is smaller.
void PackChanged(std::span<const uint8_t> values, size_t size, std::span<const uint64_t> changed,
                 uint64_t span, bool gaps_allowed, std::string* data, std::string* bitmap,
                 std::string* gaps) {
  uint64_t count = 0;
  for (const uint64_t word : changed) count += std::popcount(word);
  const uint64_t bitmap_bytes = BitmapBytes(span);
  // Each gap takes at least a byte: past one change in 8 items the bitmap
  // is smaller, and the gaps are not worth writing.
  const bool try_gaps = gaps_allowed && count < bitmap_bytes;
  if (try_gaps) gaps->reserve(count * 2);
  data->resize(count * size);
  char* out = data->data();
  uint64_t next = 0;  // the index the next gap counts from
  for (uint64_t w = 0; w < changed.size(); ++w) {
    for (uint64_t word = changed[w]; word != 0; word &= word - 1) {
      const uint64_t i = w * 64 + std::countr_zero(word);
      std::memcpy(out, values.data() + i * size, size);
      out += size;
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
    bitmap->assign(reinterpret_cast<const char*>(changed.data()), bitmap_bytes);
  }
}

}  // namespace

grpc::Slice EncodeDeltaChunk(const DeltaSpan& span, std::span<const uint8_t> values,
                             size_t element_size, std::span<const uint64_t> changed,
                             const DeltaScales* scales) {
  layercast::v1::LayerChunk chunk;
  chunk.set_tensor(span.tensor);
  chunk.set_element_offset(span.element_offset);
  chunk.set_version(span.version);
  chunk.set_base_version(span.base_version);
  chunk.set_span_elements(span.span_elements);
  PackChanged(values, element_size, changed, span.span_elements, span.gaps_allowed,
              chunk.mutable_data(), chunk.mutable_changed(), chunk.mutable_changed_gaps());
  const std::string& positions = chunk.changed().empty() ? chunk.changed_gaps() : chunk.changed();
  uint32_t crc =
      Crc32c(positions.data(), positions.size(), Crc32c(chunk.data().data(), chunk.data().size()));
  if (scales != nullptr) {
    PackChanged(scales->values, sizeof(float), scales->changed,
                scales->values.size() / sizeof(float), span.gaps_allowed, chunk.mutable_scales(),
                chunk.mutable_scales_changed(), chunk.mutable_scales_changed_gaps());
    const std::string& blocks =
        chunk.scales_changed().empty() ? chunk.scales_changed_gaps() : chunk.scales_changed();
    crc = Crc32c(blocks.data(), blocks.size(),
                 Crc32c(chunk.scales().data(), chunk.scales().size(), crc));
  }
  chunk.set_crc32c(crc);
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
absl::Status DecodeGaps(const std::string& gaps, uint64_t span, const char* field,
                        std::vector<uint64_t>& indices) {
  indices.clear();
  uint64_t next = 0;
  for (size_t at = 0; at < gaps.size();) {
    uint64_t gap = 0;
    for (int shift = 0;; shift += 7) {
      if (at == gaps.size() || shift > 63) {
        return absl::DataLossError(
            absl::StrCat("sent a delta chunk whose ", field, " end inside a varint"));
      }
      const auto byte = static_cast<uint8_t>(gaps[at++]);
      if (shift == 63 && byte > 1) {
        return absl::DataLossError(
            absl::StrCat("sent a delta chunk with a ", field, " varint over 64 bits"));
      }
      gap |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) break;
    }
    if (gap >= span - std::min(next, span)) {
      return absl::DataLossError(absl::StrCat("sent a delta chunk whose ", field,
                                              " mark an item past its span of ", span));
    }
    indices.push_back(next + gap);
    next += gap + 1;
  }
  return absl::OkStatus();
}

// One set of changed positions of a delta chunk (the elements', or an
// 8-bit float span's block scales'), checked: exactly one form, the
// bitmap's size, no position past the span, and as many values as
// positions.
struct Positions {
  const std::string* bitmap = nullptr;  // null: the gaps, in `indices`
  std::vector<uint64_t> indices;
  uint64_t count = 0;
};

// `what`: the items, for messages ("elements"); `gaps_field`: the name of
// the gaps' field.
absl::Status CheckPositions(const std::string& bitmap, const std::string& gaps, uint64_t span,
                            uint64_t values_bytes, size_t size, const char* what,
                            const char* gaps_field, Positions& positions) {
  positions.bitmap = bitmap.empty() ? nullptr : &bitmap;
  if ((!bitmap.empty() && bitmap.size() != BitmapBytes(span)) ||
      (!bitmap.empty() && !gaps.empty())) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk of ", span, " ", what, " with a ",
                                            bitmap.size(), "-byte bitmap and ", gaps.size(),
                                            " bytes of gaps, where one form is due: a ",
                                            BitmapBytes(span), "-byte bitmap or the gaps alone"));
  }
  if (!bitmap.empty()) {
    positions.count = 0;
    for (const char byte : bitmap) positions.count += std::popcount(static_cast<uint8_t>(byte));
    if (span % 8 != 0 && (static_cast<uint8_t>(bitmap.back()) >> (span % 8)) != 0) {
      return absl::DataLossError(
          absl::StrCat("sent a delta chunk whose bitmap marks ", what, " past its span"));
    }
  } else {
    if (absl::Status decoded = DecodeGaps(gaps, span, gaps_field, positions.indices);
        !decoded.ok()) {
      return decoded;
    }
    positions.count = positions.indices.size();
  }
  if (values_bytes != positions.count * size) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk marking ", positions.count,
                                            " changed ", what, " with ", values_bytes,
                                            " bytes of values"));
  }
  return absl::OkStatus();
}

// Writes the packed `values` of `positions` into `destination`.
void Scatter(const Positions& positions, const std::string& values, size_t size,
             uint8_t* destination) {
  const char* in = values.data();
  if (positions.bitmap == nullptr) {
    for (const uint64_t i : positions.indices) {
      std::memcpy(destination + i * size, in, size);
      in += size;
    }
    return;
  }
  const std::string& bitmap = *positions.bitmap;
  for (uint64_t b = 0; b < bitmap.size(); ++b) {
    for (auto byte = static_cast<uint8_t>(bitmap[b]); byte != 0; byte &= byte - 1) {
      std::memcpy(destination + (b * 8 + std::countr_zero(byte)) * size, in, size);
      in += size;
    }
  }
}

}  // namespace

absl::StatusOr<uint64_t> ApplyDeltaChunk(const layercast::v1::LayerChunk& chunk,
                                         size_t element_size, std::span<uint8_t> destination,
                                         std::span<uint8_t> scales) {
  const uint64_t span = chunk.span_elements();
  if (destination.size() != span * element_size) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk of ", span, " elements where ",
                                            destination.size() / element_size, " were due"));
  }
  const bool has_scales = !chunk.scales().empty() || !chunk.scales_changed().empty() ||
                          !chunk.scales_changed_gaps().empty();
  if (scales.empty() && has_scales) {
    return absl::DataLossError(
        absl::StrCat("sent block scales in a delta chunk of tensor ", chunk.tensor(),
                     " from element ", chunk.element_offset(), ", which is not in an 8-bit float"));
  }
  thread_local Positions elements, blocks;
  RETURN_IF_ERROR(CheckPositions(chunk.changed(), chunk.changed_gaps(), span, chunk.data().size(),
                                 element_size, "elements", "changed_gaps", elements));
  uint32_t crc = Crc32c(chunk.data().data(), chunk.data().size());
  const std::string& positions =
      elements.bitmap != nullptr ? chunk.changed() : chunk.changed_gaps();
  crc = Crc32c(positions.data(), positions.size(), crc);
  if (!scales.empty()) {
    RETURN_IF_ERROR(CheckPositions(chunk.scales_changed(), chunk.scales_changed_gaps(),
                                   scales.size() / sizeof(float), chunk.scales().size(),
                                   sizeof(float), "block scales", "scales_changed_gaps", blocks));
    const std::string& changed_blocks =
        blocks.bitmap != nullptr ? chunk.scales_changed() : chunk.scales_changed_gaps();
    crc = Crc32c(changed_blocks.data(), changed_blocks.size(),
                 Crc32c(chunk.scales().data(), chunk.scales().size(), crc));
  }
  if (chunk.has_crc32c() && crc != chunk.crc32c()) {
    return absl::DataLossError(absl::StrCat("sent a delta chunk of tensor ", chunk.tensor(),
                                            " from element ", chunk.element_offset(),
                                            " with a CRC-32C that does not match its data"));
  }
  Scatter(elements, chunk.data(), element_size, destination.data());
  if (scales.empty()) return elements.count;
  Scatter(blocks, chunk.scales(), sizeof(float), scales.data());
  return elements.count + blocks.count;
}

}  // namespace layercast::wire
