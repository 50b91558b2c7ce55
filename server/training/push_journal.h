#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/journal.pb.h"
#include "platform/clock.h"
#include "platform/file_system.h"

namespace layercast::server {

// When an appended record of a PushJournal must be on stable storage (see
// below).
enum class JournalSync { kNone, kEveryPush, kGrouped };
struct JournalDurability {
  JournalSync sync = JournalSync::kNone;
  // kGrouped: the least time between the starts of two syncs.
  std::chrono::milliseconds interval{10};
  // What `interval` is read on; null: the steady clock. A test's
  // ManualClock must outlive the journal.
  platform::Clock* clock = nullptr;
};

// What a training shard took since its last checkpoint, kept on disk so
// that a shard killed between checkpoints comes back with every push it
// acknowledged: each gradient push and each clip scale is appended here
// before the shard answers it, and a restart replays them over the
// checkpoint. Replaying gives the same bits as the steps the dead process
// applied: a step's mean is summed in worker order whatever order the
// pushes came in, and the optimizer is deterministic.
//
// Files: DIR/shard-<i>-of-<n>.journal-<generation> (16 hex digits). A
// process appends to a generation of its own, never to one a dead process
// may have left torn. A checkpoint starts a new generation (Rotate, with
// every layer paused, so what is in the older ones is in the checkpoint)
// and, once the checkpoint is durable, removes the older ones (Retire).
//
// A record: a 32-byte header (magic "LCJ1", kind, value encoding, layer,
// worker, step, value count), the values, and a CRC-32C of both. The first
// record of a generation names whose journal it is (a JournalIdentity,
// proto/layercast/v1/journal.proto, as bytes): model, layout, content,
// shard, and the checkpoint version its pushes go on from. A push
// whose values all fit bf16 exactly (a bf16 gradient widened on the shard)
// is kept as bf16: half the bytes; one with some values that do not (a
// float32 norm's gradient in a bf16 layer) is kept in blocks of 4096
// values, each bf16 where it can be (journal::kMixed). The file is written with write(2); a
// push is answered only after its record is written, and how far it is on
// disk by then is the journal's Sync policy (--journal-sync):
//   kNone: in the page cache. It survives the process's death (SIGKILL, a
//     crash, an OOM kill), not the machine's: a power loss may lose the
//     pushes of the last seconds the kernel had not written back.
//   kEveryPush: each append syncs the file (fsync) before it returns, under
//     the journal's lock: nothing acknowledged is lost to a power loss, and
//     appends wait for each other's syncs.
//   kGrouped (group commit): an append returns once a sync covering its
//     record is done, as with kEveryPush, but the appends that wait for a
//     sync share one: the first waiter leads, waits until `interval` has
//     passed since the last sync began (the pushes written meanwhile join
//     its group), then syncs them all. Nothing acknowledged is lost to a
//     power loss; a record's sync begins at most `interval` after it is
//     written, so an append takes up to `interval` plus one sync, and the
//     journal syncs at most once per `interval`. With interval 0 a group is
//     whatever was written while the last sync ran.
// Under both syncing policies a generation's file is also made durable in
// its directory before its first record returns, and a generation is synced
// before it is closed. A sync that fails (the kernel may have dropped what
// it had not written) breaks the journal: every later append fails with
// that error, since what the file holds is unknown, until a restart
// replays what it really holds.
//
// Thread-safe. An append under kGrouped blocks its thread for up to
// `interval` plus a sync.
class PushJournal final : private platform::Clock::Listener {
 public:
  using Sync = JournalSync;
  using Durability = JournalDurability;
  // "none", "every-push" or "grouped" (--journal-sync); INVALID_ARGUMENT
  // naming the three otherwise.
  static absl::StatusOr<Sync> ParseSync(absl::string_view name);
  static absl::string_view SyncName(Sync sync);

  struct Record {
    // kIdentity opens each generation; Replay checks it and visits none.
    enum class Kind : uint8_t { kPush = 1, kClipScale = 2, kIdentity = 3 };
    Kind kind = Kind::kPush;
    uint32_t layer = 0;
    uint32_t worker = 0;
    uint64_t step = 0;
    std::vector<float> values;  // kPush: the gradient; kClipScale: {scale}
  };

  // NOT_FOUND unless `dir` exists. `fs` must outlive the journal. Every
  // generation this journal starts opens with a record of `identity`
  // (unless its model_id is empty), and Replay and CheckIdentity refuse a
  // generation whose record names another model, layout, content or shard.
  static absl::StatusOr<std::unique_ptr<PushJournal>> Open(std::string dir,
                                                           layercast::v1::JournalIdentity identity,
                                                           FileSystem& fs = DefaultFileSystem(),
                                                           Durability durability = {});
  // Without an identity: records none and checks none.
  static absl::StatusOr<std::unique_ptr<PushJournal>> Open(std::string dir, uint32_t shard_index,
                                                           uint32_t num_shards,
                                                           FileSystem& fs = DefaultFileSystem(),
                                                           Durability durability = {});
  ~PushJournal();

  // FAILED_PRECONDITION naming the file and the first field that differs
  // when a generation on disk was written for another model, layout,
  // content or shard (a journal from elsewhere must not be replayed here).
  // A generation from before journals recorded their identity passes.
  absl::Status CheckIdentity() const;

  // Every whole record of the generations on disk, oldest first, to
  // `visit`. A generation that ends in a torn record (a death mid-append:
  // never answered) is replayed up to it; see journal::IsDamage
  // (server/training/journal_record.h) for how a torn tail is told from damage.
  // Damage (a bad record with more after it: acknowledged pushes lost)
  // ends the replay at the damaged record and, under OnDamage::kRefuse,
  // returns DATA_LOSS naming the file, the byte offset and the last good
  // step. Under kAccept it returns what was replayed, with `damage` set,
  // after setting the loss aside so that the journal on disk is what was
  // replayed: the generations after the damaged one are renamed
  // <name>.after-damage, the damaged one is copied whole to
  // <name>.damaged and cut at the damage (written beside it, synced and
  // renamed over it). A later start then finds a clean journal, and this
  // process's appends, in a generation of its own after it, replay on top
  // of exactly what was replayed now. Every step of that is ordered so a
  // death part way leaves either the damage (found again at the next
  // start) or the clean journal. The first error `visit` returns ends the
  // replay. Before the first Append.
  enum class OnDamage { kRefuse, kAccept };
  struct Damage {
    std::string path;                        // the damaged generation
    uint64_t offset = 0;                     // of its first bad record, bytes
    uint64_t bytes_lost = 0;                 // from there to its end
    std::optional<uint64_t> last_good_step;  // of the last record replayed
    uint32_t later_generations = 0;          // set aside, unreplayed
  };
  struct Replayed {
    uint64_t records = 0;
    uint64_t torn_tails = 0;  // generations that ended in a partial record
    std::optional<Damage> damage;
  };
  absl::StatusOr<Replayed> Replay(absl::FunctionRef<absl::Status(Record)> visit,
                                  OnDamage on_damage = OnDamage::kRefuse);

  // Appends one record and returns once it is as durable as the Sync
  // policy says. An error (a full disk) leaves the record out: the caller
  // refuses the push, and the next append starts a new generation so that
  // whatever part was written stays at a file's end. A failed sync fails
  // the append too (and every later one, see above); the whole record may
  // then be on disk, and a restart replays it: a push the worker was told
  // failed, which it pushes again anyway (the replay counts it once).
  absl::Status AppendPush(uint32_t layer, uint32_t worker, uint64_t step,
                          std::span<const float> values);
  absl::Status AppendClipScale(uint64_t step, float scale);

  // Starts a new generation for the appends after it (syncing the current
  // one under a syncing policy); returns it. The caller holds every push
  // back meanwhile, and writes a checkpoint of what the older generations
  // hold, at `checkpoint_version` (recorded in the new generation's
  // identity).
  uint64_t Rotate(uint64_t checkpoint_version = 0);
  // Removes the generations before `generation`: a checkpoint holds them.
  void Retire(uint64_t generation);

  // Bytes in the generations on disk (layercast_push_journal_bytes).
  uint64_t bytes() const;

 private:
  PushJournal(std::string dir, std::string prefix, FileSystem& fs, std::vector<uint64_t> existing,
              layercast::v1::JournalIdentity identity, Durability durability);
  // Wakes a group's leader waiting on a ManualClock.
  void Jumped() override;
  // Returns once record number `record` (appended_ when it was written) is
  // as durable as durability_ says, or the journal's sync error.
  absl::Status DurableLocked(uint64_t record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Syncs file_: every record appended so far is durable, or the journal
  // is broken.
  absl::Status SyncLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Syncs (under a syncing policy) and closes file_; the next append opens
  // a new generation.
  void CloseFileLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK, or what differs between `recorded` (in `path`) and identity_.
  absl::Status Matches(const layercast::v1::JournalIdentity& recorded,
                       const std::string& path) const;
  // The identity record of the generation in `file`, if its first record is one.
  absl::StatusOr<std::optional<layercast::v1::JournalIdentity>> ReadIdentity(
      RandomAccessFile& file) const;
  std::string PathOf(uint64_t generation) const;
  // Writes one record: `payload` as it is, or (bf16) `to_narrow`'s values
  // narrowed through narrow_, or (mixed) `payload` (its prefix and bitmap)
  // and then `to_narrow`'s blocks, each as the bitmap says.
  absl::Status AppendLocked(const Record& header, std::span<const uint8_t> payload,
                            uint8_t encoding, std::span<const float> to_narrow = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replays one generation; sets replayed.damage (path and offset) and
  // stops at damage.
  absl::Status ReplayGeneration(uint64_t generation, absl::FunctionRef<absl::Status(Record)> visit,
                                Replayed& replayed, std::optional<uint64_t>& last_step);
  // Under OnDamage::kAccept: sets the damage in generations_[index] and
  // every later generation aside, as Replay says.
  absl::Status SetDamageAside(size_t index, const Damage& damage);

  const std::string dir_;
  const std::string prefix_;  // "shard-<i>-of-<n>.journal-"
  FileSystem& fs_;
  const Durability durability_;
  platform::Clock& clock_;
  mutable absl::Mutex mu_;
  // Records appended by this process, and how many of them are durable.
  uint64_t appended_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t synced_ ABSL_GUARDED_BY(mu_) = 0;
  // kGrouped: a leader is gathering its group (it syncs under mu_).
  bool leading_ ABSL_GUARDED_BY(mu_) = false;
  // When the last sync began; nullopt before the first.
  std::optional<platform::Clock::TimePoint> last_sync_ ABSL_GUARDED_BY(mu_);
  absl::CondVar synced_cv_;  // synced_, broken_, leading_ or the clock moved
  // A sync's error, for every append after it.
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  // Generations on disk, oldest first; the last is appended to once open.
  std::vector<uint64_t> generations_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<WritableFile> file_ ABSL_GUARDED_BY(mu_);  // null until the first append
  // What each generation's first record says; model_id empty: none.
  layercast::v1::JournalIdentity identity_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> sizes_ ABSL_GUARDED_BY(mu_);  // per generation
  static constexpr size_t kNarrowBlock = 256 << 10;   // values narrowed per write
  std::vector<uint16_t> narrow_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::server
