#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "platform/file_system.h"

// One record of the push journal (server/training/push_journal.h) as it lies in a
// file, and the rule that tells a torn tail from damage. Stateless
// functions; thread-safe as RandomAccessFile::ReadAt is.
namespace layercast::server::journal {

inline constexpr uint32_t kMagic = 0x314a434c;  // "LCJ1", little-endian
// Value encodings.
inline constexpr uint8_t kFloat32 = 0;
inline constexpr uint8_t kBfloat16 = 1;
inline constexpr uint8_t kBytes = 2;  // a serialized message
// Blocks of kMixedBlock values (the last may be shorter), each bf16 or
// float32: a layer whose gradient is bf16 but for a float32 tensor (a norm
// kept in float32) is not written all in float32. The payload: a
// MixedPrefix, a bitmap of one bit per block, least significant bit first
// (set: the block is float32), in whole bytes, then each block's values.
inline constexpr uint8_t kMixed = 3;
inline constexpr uint64_t kMixedBlock = 4096;
struct MixedPrefix {
  uint64_t float32_values = 0;  // in the float32 blocks
};
static_assert(sizeof(MixedPrefix) == 8);
// Bytes of a kMixed record's bitmap for `count` values.
inline uint64_t MixedBitmapBytes(uint64_t count) {
  return (count + 8 * kMixedBlock - 1) / (8 * kMixedBlock);
}
// Record kinds (PushJournal::Record::Kind).
inline constexpr uint8_t kFirstKind = 1;
inline constexpr uint8_t kLastKind = 3;

// Bytes per value of `encoding` (kMixed: of its bf16 blocks).
inline uint64_t WidthOf(uint8_t encoding) {
  return encoding == kBfloat16 || encoding == kMixed ? 2 : encoding == kBytes ? 1 : 4;
}

// The fixed part of a record (little-endian, as every machine layercast
// builds for); `count` values of `encoding` (kMixed: with its prefix and
// bitmap) and a CRC-32C of header and values follow it.
struct Header {
  uint32_t magic = kMagic;
  uint8_t kind = 0;
  uint8_t encoding = kFloat32;
  uint16_t reserved = 0;
  uint32_t layer = 0;
  uint32_t worker = 0;
  uint64_t step = 0;
  uint64_t count = 0;
};
static_assert(sizeof(Header) == 32);

// A whole record, its CRC checked.
struct RawRecord {
  Header header;
  std::vector<uint8_t> payload;  // count * WidthOf(encoding) bytes
  uint64_t length = 0;           // header, payload and CRC
};

// The whole record at `offset` of `file`, or nullopt when none is there (a
// header that is cut short or makes no sense, values that run past the
// file's end, or a CRC that fails). An error only when `file` cannot be
// read.
absl::StatusOr<std::optional<RawRecord>> ReadRecord(const RandomAccessFile& file, uint64_t offset);

// Whether the bad record at `offset` (ReadRecord gave nullopt) is damage
// rather than a torn tail.
//
// A torn tail is what a process that dies while appending leaves: the file
// ends inside its last record (a header cut short, or values or the CRC
// missing), or its last record is whole in length but fails its CRC with
// nothing after it (a machine that lost the page cache may leave zeros
// there). Nothing was ever appended after a torn record: each process
// appends to a generation of its own.
//
// Damage is anything else: a record whose header makes sense and whose CRC
// fails with bytes after it, or any bad record after which a whole record
// (plausible header, CRC matching) starts. Such a file lost records that
// were acknowledged. The search for a later record looks at each offset
// after `offset` holding the magic, at most 4096 of them with a plausible
// header; past that it answers damage, the side that stops a start.
absl::StatusOr<bool> IsDamage(const RandomAccessFile& file, uint64_t offset);

}  // namespace layercast::server::journal
