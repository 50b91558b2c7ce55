#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "platform/file_system.h"

namespace layercast::server {

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
// worker, step, value count), the values, and a CRC-32C of both. A push
// whose values all fit bf16 exactly (a bf16 gradient widened on the shard)
// is kept as bf16: half the bytes. The file is written with write(2) and
// not synced: a record survives the process's death (SIGKILL, a crash, an
// OOM kill), not the machine's; a push is answered only after its record
// is written.
//
// Thread-safe.
class PushJournal {
 public:
  struct Record {
    enum class Kind : uint8_t { kPush = 1, kClipScale = 2 };
    Kind kind = Kind::kPush;
    uint32_t layer = 0;
    uint32_t worker = 0;
    uint64_t step = 0;
    std::vector<float> values;  // kPush: the gradient; kClipScale: {scale}
  };

  // NOT_FOUND unless `dir` exists. `fs` must outlive the journal.
  static absl::StatusOr<std::unique_ptr<PushJournal>> Open(std::string dir, uint32_t shard_index,
                                                           uint32_t num_shards,
                                                           FileSystem& fs = DefaultFileSystem());

  // Every whole record of the generations on disk, oldest first, to
  // `visit`; a generation's records end at the first torn or damaged one
  // (a death mid-append: never answered). The first error `visit` returns
  // ends the replay. Before the first Append.
  struct Replayed {
    uint64_t records = 0;
    uint64_t torn_tails = 0;  // generations that ended in a partial record
  };
  absl::StatusOr<Replayed> Replay(absl::FunctionRef<absl::Status(Record)> visit);

  // Appends one record. An error (a full disk) leaves the record out: the
  // caller refuses the push, and the next append starts a new generation so
  // that whatever part was written stays at a file's end.
  absl::Status AppendPush(uint32_t layer, uint32_t worker, uint64_t step,
                          std::span<const float> values);
  absl::Status AppendClipScale(uint64_t step, float scale);

  // Starts a new generation for the appends after it; returns it. The
  // caller holds every push back meanwhile, and writes a checkpoint of
  // what the older generations hold.
  uint64_t Rotate();
  // Removes the generations before `generation`: a checkpoint holds them.
  void Retire(uint64_t generation);

  // Bytes in the generations on disk (layercast_push_journal_bytes).
  uint64_t bytes() const;

 private:
  PushJournal(std::string dir, std::string prefix, FileSystem& fs, std::vector<uint64_t> existing);
  std::string PathOf(uint64_t generation) const;
  // Writes one record: `payload` as it is, or (bf16) `to_narrow`'s values
  // narrowed through narrow_.
  absl::Status AppendLocked(const Record& header, std::span<const uint8_t> payload,
                            uint8_t encoding, std::span<const float> to_narrow = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReplayGeneration(uint64_t generation, absl::FunctionRef<absl::Status(Record)> visit,
                                Replayed& replayed);

  const std::string dir_;
  const std::string prefix_;  // "shard-<i>-of-<n>.journal-"
  FileSystem& fs_;
  mutable absl::Mutex mu_;
  // Generations on disk, oldest first; the last is appended to once open.
  std::vector<uint64_t> generations_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<WritableFile> file_ ABSL_GUARDED_BY(mu_);  // null until the first append
  std::vector<uint64_t> sizes_ ABSL_GUARDED_BY(mu_);         // per generation
  static constexpr size_t kNarrowBlock = 256 << 10;          // values narrowed per write
  std::vector<uint16_t> narrow_ ABSL_GUARDED_BY(mu_);
};

}  // namespace layercast::server
