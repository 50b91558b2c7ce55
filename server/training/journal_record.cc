#include "server/training/journal_record.h"

#include <algorithm>
#include <cstring>

#include "core/crc32c.h"
#include "platform/status_macros.h"

namespace layercast::server::journal {
namespace {

constexpr uint64_t kTrailer = sizeof(uint32_t);  // the CRC
constexpr uint64_t kScanBlock = 1 << 20;
constexpr int kMaxCandidates = 4096;

// The header at `offset`, or nullopt when fewer than its bytes remain.
absl::StatusOr<std::optional<Header>> ReadHeader(const RandomAccessFile& file, uint64_t offset) {
  if (offset > file.size() || file.size() - offset < sizeof(Header)) return std::nullopt;
  Header header;
  RETURN_IF_ERROR(file.ReadAt(offset, {reinterpret_cast<uint8_t*>(&header), sizeof(header)}));
  return header;
}

// The length of the record `header` starts at `offset`, or nullopt when
// its encoding is unknown or it would run past the file's end (a kMixed
// one's prefix read from `file`).
absl::StatusOr<std::optional<uint64_t>> LengthWithin(const RandomAccessFile& file, uint64_t offset,
                                                     const Header& header) {
  if (header.magic != kMagic || header.encoding > kMixed) return std::nullopt;
  const uint64_t left = file.size() - offset;
  if (left < sizeof(Header) + kTrailer) return std::nullopt;
  const uint64_t room = left - sizeof(Header) - kTrailer;
  const uint64_t width = WidthOf(header.encoding);
  if (header.count > room / width) return std::nullopt;
  if (header.encoding != kMixed) return sizeof(Header) + header.count * width + kTrailer;
  MixedPrefix prefix;
  if (room < sizeof(prefix)) return std::nullopt;
  RETURN_IF_ERROR(
      file.ReadAt(offset + sizeof(Header), {reinterpret_cast<uint8_t*>(&prefix), sizeof(prefix)}));
  if (prefix.float32_values > header.count) return std::nullopt;
  // Each float32 value takes two bytes more than a bf16 one; count <=
  // room / 2, so none of this overflows.
  const uint64_t payload = sizeof(prefix) + MixedBitmapBytes(header.count) + 2 * header.count +
                           2 * prefix.float32_values;
  if (payload > room) return std::nullopt;
  return sizeof(Header) + payload + kTrailer;
}

// Whether a kMixed payload's bitmap counts as many float32 values as its
// prefix says (its CRC matched: only a writer's bug makes them differ).
bool MixedIsConsistent(const RawRecord& record) {
  MixedPrefix prefix;
  std::memcpy(&prefix, record.payload.data(), sizeof(prefix));
  const uint64_t count = record.header.count;
  uint64_t float32_values = 0;
  for (uint64_t block = 0; block * kMixedBlock < count; ++block) {
    if ((record.payload[sizeof(prefix) + block / 8] >> (block % 8)) & 1) {
      float32_values += std::min(kMixedBlock, count - block * kMixedBlock);
    }
  }
  return float32_values == prefix.float32_values;
}

// Whether a whole record starts at `offset`, its header as a writer writes
// one (a known kind, nothing in the reserved bits) and its CRC matching.
absl::StatusOr<bool> WholeRecordAt(const RandomAccessFile& file, uint64_t offset) {
  ASSIGN_OR_RETURN(const std::optional<Header> header, ReadHeader(file, offset));
  if (!header || header->kind < kFirstKind || header->kind > kLastKind || header->reserved != 0) {
    return false;
  }
  ASSIGN_OR_RETURN(const std::optional<uint64_t> length, LengthWithin(file, offset, *header));
  if (!length) return false;
  ASSIGN_OR_RETURN(const std::optional<RawRecord> record, ReadRecord(file, offset));
  return record.has_value();
}

}  // namespace

absl::StatusOr<std::optional<RawRecord>> ReadRecord(const RandomAccessFile& file, uint64_t offset) {
  ASSIGN_OR_RETURN(const std::optional<Header> header, ReadHeader(file, offset));
  if (!header) return std::nullopt;
  ASSIGN_OR_RETURN(const std::optional<uint64_t> length, LengthWithin(file, offset, *header));
  if (!length) return std::nullopt;
  RawRecord record;
  record.header = *header;
  record.length = *length;
  record.payload.resize(*length - sizeof(Header) - kTrailer);
  RETURN_IF_ERROR(file.ReadAt(offset + sizeof(Header), record.payload));
  uint32_t stored_crc = 0;
  RETURN_IF_ERROR(file.ReadAt(offset + sizeof(Header) + record.payload.size(),
                              {reinterpret_cast<uint8_t*>(&stored_crc), sizeof(stored_crc)}));
  const uint32_t crc =
      Crc32c(record.payload.data(), record.payload.size(), Crc32c(&*header, sizeof(Header)));
  if (crc != stored_crc) return std::nullopt;
  if (header->encoding == kMixed && !MixedIsConsistent(record)) return std::nullopt;
  return record;
}

absl::StatusOr<bool> IsDamage(const RandomAccessFile& file, uint64_t offset) {
  ASSIGN_OR_RETURN(const std::optional<Header> header, ReadHeader(file, offset));
  if (header) {
    ASSIGN_OR_RETURN(const std::optional<uint64_t> length, LengthWithin(file, offset, *header));
    // A header that makes sense, a record that fits, a CRC that fails: a
    // torn write never leaves bytes after it.
    if (length) return offset + *length < file.size();
  }
  // The header is cut short, makes no sense, or claims more than the file
  // holds (its count may be what is damaged): look for a whole record after.
  std::vector<uint8_t> block;
  int candidates = 0;
  for (uint64_t at = offset + 1; at + sizeof(Header) + kTrailer <= file.size();) {
    const uint64_t n = std::min<uint64_t>(kScanBlock, file.size() - at);
    block.resize(n);
    RETURN_IF_ERROR(file.ReadAt(at, block));
    for (uint64_t i = 0; i + sizeof(kMagic) <= n; ++i) {
      uint32_t word = 0;
      std::memcpy(&word, block.data() + i, sizeof(word));
      if (word != kMagic) continue;
      if (++candidates > kMaxCandidates) return true;
      ASSIGN_OR_RETURN(const bool whole, WholeRecordAt(file, at + i));
      if (whole) return true;
    }
    if (n < sizeof(kMagic)) break;
    at += n - (sizeof(kMagic) - 1);  // a magic across two blocks is seen once
  }
  return false;
}

}  // namespace layercast::server::journal
