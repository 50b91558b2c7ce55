#include "server/training/push_journal.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "core/crc32c.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "server/training/journal_record.h"

// PushJournal's reading side: the identity each generation opens with,
// checked against this shard's, and the replay of what the generations
// hold, with the damage it may find set aside. The writer (appends,
// syncs, rotation) is push_journal.cc.

namespace layercast::server {
namespace {

using journal::Header;
using journal::kBfloat16;
using journal::kBytes;
using journal::kMagic;
using journal::kMixed;
using journal::kMixedBlock;
using journal::MixedBitmapBytes;
using journal::MixedPrefix;
using journal::WidthOf;

// bf16 values at `from` into `to`, through core's cast (exact). Copied into
// `narrow` first: `from` is a byte offset into the record, which core's
// uint16_t reads may not be aligned for.
void Widen(const uint8_t* from, std::span<float> to, std::vector<uint16_t>& narrow) {
  narrow.resize(to.size());
  std::memcpy(narrow.data(), from, 2 * to.size());
  CastBF16ToF32(narrow, to);
}

}  // namespace

absl::Status PushJournal::Matches(const layercast::v1::JournalIdentity& recorded,
                                  const std::string& path) const {
  layercast::v1::JournalIdentity own;
  {
    absl::MutexLock lock(&mu_);
    own = identity_;
  }
  if (own.model_id().empty()) return absl::OkStatus();
  std::string differs;
  if (recorded.model_id() != own.model_id()) {
    differs = absl::StrCat("model '", recorded.model_id(), "', and this shard serves '",
                           own.model_id(), "'");
  } else if (recorded.shard_index() != own.shard_index() ||
             recorded.num_shards() != own.num_shards()) {
    differs = absl::StrCat("shard ", recorded.shard_index(), " of ", recorded.num_shards(),
                           ", and this is shard ", own.shard_index(), " of ", own.num_shards());
  } else if (recorded.layout_digest() != own.layout_digest()) {
    differs = absl::StrCat(
        "another layout (digest ", absl::BytesToHexString(recorded.layout_digest()).substr(0, 16),
        "... where this shard's is ", absl::BytesToHexString(own.layout_digest()).substr(0, 16),
        "...: another policy or model shape)");
  } else if (recorded.content_fingerprint() != own.content_fingerprint()) {
    differs = absl::StrCat("other values (content fingerprint ",
                           absl::BytesToHexString(recorded.content_fingerprint()).substr(0, 16),
                           "... where this shard's is ",
                           absl::BytesToHexString(own.content_fingerprint()).substr(0, 16), "...)");
  } else {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "push journal ", path, " was written for ", differs, " (going on from checkpoint version ",
      recorded.checkpoint_version(),
      "): it is not this shard's. Move it out of --checkpoint-dir, or point --checkpoint-dir at "
      "this shard's own"));
}

absl::StatusOr<std::optional<layercast::v1::JournalIdentity>> PushJournal::ReadIdentity(
    RandomAccessFile& file) const {
  Header header;
  if (file.size() < sizeof(Header) + sizeof(uint32_t)) return std::nullopt;
  RETURN_IF_ERROR(file.ReadAt(0, {reinterpret_cast<uint8_t*>(&header), sizeof(header)}));
  if (header.magic != kMagic || header.kind != static_cast<uint8_t>(Record::Kind::kIdentity) ||
      header.encoding != kBytes || header.count > file.size() - sizeof(Header) - sizeof(uint32_t)) {
    return std::nullopt;
  }
  std::vector<uint8_t> payload(header.count);
  RETURN_IF_ERROR(file.ReadAt(sizeof(Header), payload));
  uint32_t stored_crc = 0;
  RETURN_IF_ERROR(file.ReadAt(sizeof(Header) + payload.size(),
                              {reinterpret_cast<uint8_t*>(&stored_crc), sizeof(stored_crc)}));
  layercast::v1::JournalIdentity identity;
  if (Crc32c(payload.data(), payload.size(), Crc32c(&header, sizeof(header))) != stored_crc ||
      !identity.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::DataLossError(
        absl::StrCat("push journal ", file.path(),
                     ": its identity record is damaged (its CRC or its contents); "
                     "move the file aside to start without it"));
  }
  return identity;
}

absl::Status PushJournal::CheckIdentity() const {
  std::vector<uint64_t> generations;
  {
    absl::MutexLock lock(&mu_);
    generations = generations_;
  }
  for (const uint64_t generation : generations) {
    ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, fs_.OpenForRead(PathOf(generation)));
    ASSIGN_OR_RETURN(const std::optional<layercast::v1::JournalIdentity> recorded,
                     ReadIdentity(*file));
    if (recorded) RETURN_IF_ERROR(Matches(*recorded, file->path()));
  }
  return absl::OkStatus();
}

absl::StatusOr<PushJournal::Replayed> PushJournal::Replay(
    absl::FunctionRef<absl::Status(Record)> visit, OnDamage on_damage) {
  std::vector<uint64_t> generations;
  {
    absl::MutexLock lock(&mu_);
    generations = generations_;
  }
  Replayed replayed;
  std::optional<uint64_t> last_step;
  for (size_t i = 0; i < generations.size(); ++i) {
    RETURN_IF_ERROR(ReplayGeneration(generations[i], visit, replayed, last_step));
    if (!replayed.damage) continue;
    // Nothing after damage is replayed: the later generations' pushes went
    // on from records that are lost.
    Damage& damage = *replayed.damage;
    damage.last_good_step = last_step;
    damage.later_generations = static_cast<uint32_t>(generations.size() - i - 1);
    const std::string last_good =
        last_step ? absl::StrCat("step ", *last_step) : std::string("none (no record before it)");
    if (on_damage == OnDamage::kRefuse) {
      return absl::DataLossError(absl::StrCat(
          "push journal ", damage.path, " is damaged at byte ", damage.offset,
          ": a bad record with valid records after it, not a torn tail; last good step: ",
          last_good, ". ", damage.bytes_lost, " byte(s) from there and ", damage.later_generations,
          " later generation(s) hold acknowledged pushes that would be lost. Restore the file, "
          "or pass --accept-journal-damage true to start from the last good record"));
    }
    RETURN_IF_ERROR(SetDamageAside(i, damage));
    break;
  }
  return replayed;
}

absl::Status PushJournal::ReplayGeneration(uint64_t generation,
                                           absl::FunctionRef<absl::Status(Record)> visit,
                                           Replayed& replayed, std::optional<uint64_t>& last_step) {
  ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, fs_.OpenForRead(PathOf(generation)));
  ASSIGN_OR_RETURN(const std::optional<layercast::v1::JournalIdentity> recorded,
                   ReadIdentity(*file));
  if (recorded) RETURN_IF_ERROR(Matches(*recorded, file->path()));
  uint64_t offset = 0;
  std::vector<uint16_t> narrow;  // Widen's, kept across records
  while (offset < file->size()) {
    ASSIGN_OR_RETURN(std::optional<journal::RawRecord> raw, journal::ReadRecord(*file, offset));
    if (!raw) {
      ASSIGN_OR_RETURN(const bool damage, journal::IsDamage(*file, offset));
      if (damage) {
        Damage found;
        found.path = file->path();
        found.offset = offset;
        found.bytes_lost = file->size() - offset;
        replayed.damage = std::move(found);
        return absl::OkStatus();
      }
      ++replayed.torn_tails;
      Log()->warn(
          "push journal {}: a partial record at byte {} (a death while it was written; "
          "that push was never answered), {} bytes after it ignored",
          file->path(), offset, file->size() - offset);
      return absl::OkStatus();
    }
    const Header& header = raw->header;
    offset += raw->length;
    if (header.kind == static_cast<uint8_t>(Record::Kind::kIdentity)) {
      continue;  // checked above, before any push
    }
    Record record;
    record.kind = static_cast<Record::Kind>(header.kind);
    record.layer = header.layer;
    record.worker = header.worker;
    record.step = header.step;
    record.values.resize(header.count);
    if (header.encoding == kBfloat16) {
      Widen(raw->payload.data(), record.values, narrow);
    } else if (header.encoding == kMixed) {
      // ReadRecord checked the bitmap against the prefix and the length.
      const uint8_t* bitmap = raw->payload.data() + sizeof(MixedPrefix);
      const uint8_t* from = bitmap + MixedBitmapBytes(header.count);
      for (uint64_t at = 0, block = 0; at < header.count; at += kMixedBlock, ++block) {
        const std::span<float> to(record.values.data() + at,
                                  std::min(kMixedBlock, header.count - at));
        if ((bitmap[block / 8] >> (block % 8)) & 1) {
          std::memcpy(to.data(), from, to.size_bytes());
          from += to.size_bytes();
        } else {
          Widen(from, to, narrow);
          from += 2 * to.size();
        }
      }
    } else {
      std::memcpy(record.values.data(), raw->payload.data(), raw->payload.size());
    }
    ++replayed.records;
    last_step = record.step;
    RETURN_IF_ERROR(visit(std::move(record)));
  }
  return absl::OkStatus();
}

absl::Status PushJournal::SetDamageAside(size_t index, const Damage& damage) {
  std::vector<uint64_t> generations;
  {
    absl::MutexLock lock(&mu_);
    generations = generations_;
  }
  // Later generations first: until the damaged one is cut, a death here
  // leaves the damage to be found at the next start.
  for (size_t i = index + 1; i < generations.size(); ++i) {
    const std::string path = PathOf(generations[i]);
    RETURN_IF_ERROR(fs_.Rename(path, absl::StrCat(path, ".after-damage")));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, fs_.OpenForRead(damage.path));
  // Copies [0, end) of `file` to `to`, synced.
  const auto copy = [&](const std::string& to, uint64_t end) -> absl::Status {
    ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out, fs_.OpenForWrite(to));
    std::vector<uint8_t> block;
    for (uint64_t at = 0; at < end;) {
      block.resize(std::min<uint64_t>(end - at, 1 << 20));
      RETURN_IF_ERROR(file->ReadAt(at, block));
      RETURN_IF_ERROR(out->Append(block));
      at += block.size();
    }
    RETURN_IF_ERROR(out->Sync());
    return out->Close();
  };
  RETURN_IF_ERROR(copy(absl::StrCat(damage.path, ".damaged"), file->size()));
  const std::string cut = absl::StrCat(damage.path, ".cut");
  RETURN_IF_ERROR(copy(cut, damage.offset));
  RETURN_IF_ERROR(fs_.Rename(cut, damage.path));
  RETURN_IF_ERROR(fs_.SyncDir(dir_));
  absl::MutexLock lock(&mu_);
  generations_.resize(index + 1);
  sizes_.resize(index + 1);
  sizes_.back() = damage.offset;
  return absl::OkStatus();
}

}  // namespace layercast::server
