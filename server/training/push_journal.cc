#include "server/training/push_journal.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/crc32c.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "server/training/journal_record.h"

// PushJournal's writer: opening a journal, appending records as durably
// as its Sync policy says, and the generations a checkpoint rotates and
// retires. Reading them back is push_journal_replay.cc.

namespace layercast::server {
namespace {

using journal::Header;
using journal::kBfloat16;
using journal::kBytes;
using journal::kFloat32;
using journal::kMagic;
using journal::kMixed;
using journal::kMixedBlock;
using journal::MixedBitmapBytes;
using journal::MixedPrefix;
using journal::WidthOf;

std::span<const uint8_t> BytesOf(const void* data, size_t size) {
  return {static_cast<const uint8_t*>(data), size};
}

// Whether each value is a bf16 value exactly (its low 16 bits are zero):
// a bf16 gradient widened on the shard then costs half the disk.
bool AllBf16(std::span<const float> values) {
  uint32_t low = 0;
  for (const float value : values) low |= std::bit_cast<uint32_t>(value) & 0xffff;
  return low == 0;
}

// A kMixed record's prefix and bitmap for `values`: which blocks of
// kMixedBlock hold a value that is not a bf16 value.
std::vector<uint8_t> MixedPreamble(std::span<const float> values) {
  std::vector<uint8_t> preamble(sizeof(MixedPrefix) + MixedBitmapBytes(values.size()));
  MixedPrefix prefix;
  for (size_t at = 0, block = 0; at < values.size(); at += kMixedBlock, ++block) {
    const auto values_of_block = values.subspan(at, std::min(kMixedBlock, values.size() - at));
    if (AllBf16(values_of_block)) continue;
    preamble[sizeof(prefix) + block / 8] |= static_cast<uint8_t>(1u << (block % 8));
    prefix.float32_values += values_of_block.size();
  }
  std::memcpy(preamble.data(), &prefix, sizeof(prefix));
  return preamble;
}

}  // namespace

absl::StatusOr<PushJournal::Sync> PushJournal::ParseSync(absl::string_view name) {
  for (const Sync sync : {Sync::kNone, Sync::kEveryPush, Sync::kGrouped}) {
    if (name == SyncName(sync)) return sync;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "journal sync '", name,
      "' is not one of: none (the page cache: a process's death loses nothing acknowledged, a "
      "power loss may), every-push (a sync before each push is answered), grouped (pushes "
      "share a sync, at most one per --journal-sync-interval-ms, each answered after it)"));
}

absl::string_view PushJournal::SyncName(Sync sync) {
  switch (sync) {
    case Sync::kNone:
      return "none";
    case Sync::kEveryPush:
      return "every-push";
    case Sync::kGrouped:
      return "grouped";
  }
  return "?";
}

PushJournal::PushJournal(std::string dir, std::string prefix, FileSystem& fs,
                         std::vector<uint64_t> existing, layercast::v1::JournalIdentity identity,
                         Durability durability)
    : dir_(std::move(dir)),
      prefix_(std::move(prefix)),
      fs_(fs),
      durability_(durability),
      clock_(durability.clock != nullptr ? *durability.clock : platform::Clock::Steady()) {
  if (durability_.sync == Sync::kGrouped) clock_.Listen(this);
  generations_ = std::move(existing);
  identity_ = std::move(identity);
  for (const uint64_t generation : generations_) {
    std::error_code error;
    const auto size = std::filesystem::file_size(PathOf(generation), error);
    sizes_.push_back(error ? 0 : size);
  }
}

PushJournal::~PushJournal() {
  if (durability_.sync == Sync::kGrouped) clock_.Unlisten(this);
}

void PushJournal::Jumped() {
  absl::MutexLock lock(&mu_);
  synced_cv_.SignalAll();
}

absl::StatusOr<std::unique_ptr<PushJournal>> PushJournal::Open(std::string dir,
                                                               uint32_t shard_index,
                                                               uint32_t num_shards, FileSystem& fs,
                                                               Durability durability) {
  layercast::v1::JournalIdentity identity;
  identity.set_shard_index(shard_index);
  identity.set_num_shards(num_shards);
  return Open(std::move(dir), std::move(identity), fs, durability);
}

absl::StatusOr<std::unique_ptr<PushJournal>> PushJournal::Open(
    std::string dir, layercast::v1::JournalIdentity identity, FileSystem& fs,
    Durability durability) {
  const std::string prefix =
      absl::StrCat("shard-", identity.shard_index(), "-of-", identity.num_shards(), ".journal-");
  // Listing a directory is not part of the FileSystem seam; as in
  // CheckpointManager, only names are read here.
  std::vector<uint64_t> generations;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    uint64_t generation = 0;
    if (absl::StartsWith(name, prefix) && name.size() == prefix.size() + 16 &&
        absl::SimpleHexAtoi(absl::string_view(name).substr(prefix.size()), &generation)) {
      generations.push_back(generation);
    }
  }
  if (error) {
    return absl::Status(absl::ErrnoToStatusCode(error.value()),
                        absl::StrCat("cannot list --checkpoint-dir ", dir,
                                     " for the push journal: ", error.message()));
  }
  std::sort(generations.begin(), generations.end());
  return std::unique_ptr<PushJournal>(new PushJournal(
      std::move(dir), prefix, fs, std::move(generations), std::move(identity), durability));
}

std::string PushJournal::PathOf(uint64_t generation) const {
  return absl::StrCat(dir_, "/", prefix_, absl::Hex(generation, absl::kZeroPad16));
}

absl::Status PushJournal::AppendPush(uint32_t layer, uint32_t worker, uint64_t step,
                                     std::span<const float> values) {
  Record header;
  header.layer = layer;
  header.worker = worker;
  header.step = step;
  // Per block: a layer of bf16 gradients but for a float32 norm is mostly
  // bf16, and written so (a whole-record choice wrote it all in float32,
  // nearly twice the bytes: the copy into the page cache is most of what
  // the journal costs a step).
  const std::vector<uint8_t> preamble = MixedPreamble(values);
  MixedPrefix prefix;
  std::memcpy(&prefix, preamble.data(), sizeof(prefix));
  absl::MutexLock lock(&mu_);
  if (prefix.float32_values == values.size() && !values.empty()) {
    RETURN_IF_ERROR(AppendLocked(header, BytesOf(values.data(), values.size_bytes()), kFloat32));
  } else {
    // Narrowed a block at a time into a buffer kept for the next push: no
    // copy of the whole gradient, and no fresh pages to fault in.
    narrow_.resize(std::min<size_t>(values.size(), kNarrowBlock));
    if (prefix.float32_values == 0) {
      RETURN_IF_ERROR(AppendLocked(header, {}, kBfloat16, values));
    } else {
      RETURN_IF_ERROR(AppendLocked(header, preamble, kMixed, values));
    }
  }
  return DurableLocked(appended_);
}

absl::Status PushJournal::AppendClipScale(uint64_t step, float scale) {
  Record header;
  header.kind = Record::Kind::kClipScale;
  header.step = step;
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(AppendLocked(header, BytesOf(&scale, sizeof(scale)), kFloat32));
  return DurableLocked(appended_);
}

absl::Status PushJournal::DurableLocked(uint64_t record) {
  switch (durability_.sync) {
    case Sync::kNone:
      return absl::OkStatus();
    case Sync::kEveryPush:
      return record <= synced_ ? absl::OkStatus() : SyncLocked();
    case Sync::kGrouped:
      break;
  }
  while (record > synced_) {
    if (!broken_.ok()) return broken_;
    if (leading_) {
      synced_cv_.Wait(&mu_);
      continue;
    }
    // This append leads the next group: it gathers until `interval` has
    // passed since the last sync began (appends go on meanwhile: the wait
    // releases mu_), then syncs all of them, holding mu_ so that no append
    // or rotation touches the file during the sync. A record's sync thus
    // begins at most `interval` after it was written: the last sync began
    // before it was (one after would have covered it).
    leading_ = true;
    if (last_sync_) {
      const platform::Clock::TimePoint due = *last_sync_ + durability_.interval;
      for (auto now = clock_.Now(); now < due && record > synced_ && broken_.ok();
           now = clock_.Now()) {
        synced_cv_.WaitWithTimeout(&mu_, absl::FromChrono(due - now));
      }
    }
    if (record > synced_) (void)SyncLocked();  // an error breaks the journal: returned above
    leading_ = false;
    synced_cv_.SignalAll();
  }
  return absl::OkStatus();
}

absl::Status PushJournal::SyncLocked() {
  if (!broken_.ok()) return broken_;
  last_sync_ = clock_.Now();
  const uint64_t through = appended_;
  if (file_ != nullptr) {
    if (const absl::Status synced = file_->Sync(); !synced.ok()) {
      broken_ = absl::Status(
          synced.code(),
          absl::StrCat("the push journal could not be synced (", synced.message(),
                       "), so what its file holds on disk is unknown: this shard takes no more "
                       "pushes; restart it once the disk is sound, and it replays what the "
                       "journal holds"));
      Log()->error("{}", broken_.message());
      synced_cv_.SignalAll();
      return broken_;
    }
  }
  synced_ = through;
  synced_cv_.SignalAll();
  return absl::OkStatus();
}

void PushJournal::CloseFileLocked() {
  if (file_ == nullptr) return;
  // Records still waiting for their group's sync are in this file.
  if (durability_.sync != Sync::kNone && synced_ < appended_) (void)SyncLocked();
  (void)file_->Close();
  file_.reset();
}

absl::Status PushJournal::AppendLocked(const Record& record, std::span<const uint8_t> payload,
                                       uint8_t encoding, std::span<const float> to_narrow) {
  if (!broken_.ok()) return broken_;
  if (file_ == nullptr) {
    // A generation of this process's own, after any on disk.
    const uint64_t generation = generations_.empty() ? 1 : generations_.back() + 1;
    ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs_.OpenForWrite(PathOf(generation)));
    // Its name durable before any record in it is answered as durable.
    if (durability_.sync != Sync::kNone) RETURN_IF_ERROR(fs_.SyncDir(dir_));
    file_ = std::move(file);
    generations_.push_back(generation);
    sizes_.push_back(0);
    if (!identity_.model_id().empty()) {
      const std::string identity = identity_.SerializeAsString();
      Record named;
      named.kind = Record::Kind::kIdentity;
      RETURN_IF_ERROR(AppendLocked(named, BytesOf(identity.data(), identity.size()), kBytes));
    }
  }
  Header header;
  header.kind = static_cast<uint8_t>(record.kind);
  header.encoding = encoding;
  header.layer = record.layer;
  header.worker = record.worker;
  header.step = record.step;
  const bool narrowed = encoding == kBfloat16 || encoding == kMixed;
  header.count = narrowed ? to_narrow.size() : payload.size() / WidthOf(encoding);
  uint32_t crc = Crc32c(&header, sizeof(header));
  absl::Status written = file_->Append(BytesOf(&header, sizeof(header)));
  uint64_t payload_bytes = 0;
  // Named here, under mu_: clang's thread-safety analysis does not see the
  // lock held inside the lambdas below.
  WritableFile& file = *file_;
  const std::span<uint16_t> narrow(narrow_);
  const auto write = [&](std::span<const uint8_t> bytes) {
    crc = Crc32c(bytes.data(), bytes.size(), crc);
    payload_bytes += bytes.size();
    if (written.ok()) written = file.Append(bytes);
  };
  const auto write_narrowed = [&](std::span<const float> values) {
    for (size_t at = 0; written.ok() && at < values.size(); at += narrow.size()) {
      const size_t n = std::min(narrow.size(), values.size() - at);
      for (size_t i = 0; i < n; ++i) {
        narrow[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(values[at + i]) >> 16);
      }
      write(BytesOf(narrow.data(), 2 * n));
    }
  };
  if (!narrowed) {
    write(payload);
  } else if (encoding == kBfloat16) {
    write_narrowed(to_narrow);
  } else {
    // The prefix and bitmap, then each run of blocks of one width.
    write(payload);
    const std::span<const uint8_t> bitmap = payload.subspan(sizeof(MixedPrefix));
    const auto wide = [&](size_t block) { return (bitmap[block / 8] >> (block % 8)) & 1; };
    const size_t blocks = (to_narrow.size() + kMixedBlock - 1) / kMixedBlock;
    for (size_t block = 0; written.ok() && block < blocks;) {
      size_t end = block + 1;
      while (end < blocks && wide(end) == wide(block)) ++end;
      const size_t at = block * kMixedBlock;
      const auto run = to_narrow.subspan(at, std::min(end * kMixedBlock, to_narrow.size()) - at);
      if (wide(block)) {
        write(BytesOf(run.data(), run.size_bytes()));
      } else {
        write_narrowed(run);
      }
      block = end;
    }
  }
  if (written.ok()) written = file_->Append(BytesOf(&crc, sizeof(crc)));
  if (!written.ok()) {
    // Whatever part was written stays at this generation's end, where a
    // replay stops; the next record goes to a new one.
    CloseFileLocked();
    return absl::Status(written.code(),
                        absl::StrCat("the push could not be journaled (", written.message(),
                                     "), so it was not taken: free space in --checkpoint-dir, "
                                     "then push again"));
  }
  sizes_.back() += sizeof(header) + payload_bytes + sizeof(crc);
  ++appended_;
  return absl::OkStatus();
}

uint64_t PushJournal::Rotate(uint64_t checkpoint_version) {
  absl::MutexLock lock(&mu_);
  identity_.set_checkpoint_version(checkpoint_version);
  CloseFileLocked();
  // The next append opens generation back() + 1: what is on disk now is
  // what the checkpoint will hold.
  return generations_.empty() ? 1 : generations_.back() + 1;
}

void PushJournal::Retire(uint64_t generation) {
  absl::MutexLock lock(&mu_);
  size_t kept = 0;
  for (size_t i = 0; i < generations_.size(); ++i) {
    if (generations_[i] < generation) {
      if (absl::Status removed = fs_.Remove(PathOf(generations_[i])); !removed.ok()) {
        Log()->warn("push journal: {} (replaying it again is harmless)", removed.message());
      }
      continue;
    }
    generations_[kept] = generations_[i];
    sizes_[kept] = sizes_[i];
    ++kept;
  }
  generations_.resize(kept);
  sizes_.resize(kept);
}

uint64_t PushJournal::bytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const uint64_t size : sizes_) total += size;
  return total;
}

}  // namespace layercast::server
