#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "layercast/v1/journal.pb.h"
#include "platform/file_system.h"
#include "server/training/push_journal.h"

namespace layercast::server {

// The push journals of shards `from_shards` of N (those whose slices overlap
// shard j of M's), read for a shard that starts from their checkpoints
// resharded (server/checkpoints/checkpoint_reshard.h): every push cut to shard j's
// elements of its layer, the pieces of one push (layer, worker, step) from
// the N journals put together, and every clip scale once; in an order
// TrainerCheckpoint::Replay takes (by step, a step's pushes before its scale).
//
// A push that some of the overlapping journals hold and others do not was
// never acknowledged by the whole set (a journal record precedes each
// answer), so its worker pushes it again: it is left out (`incomplete`
// counts them). A clip scale recorded with two values is damage.
//
// `identity` is the new shard's; each journal must match it but for the
// shard index and count (PushJournal::CheckIdentity). Damage in any journal
// refuses (DATA_LOSS naming the file): start the N shards to accept it with
// --accept-journal-damage, then reshard.
struct ReshardedRecords {
  std::vector<PushJournal::Record> records;
  uint64_t read = 0;        // records in the journals
  uint64_t incomplete = 0;  // pushes left out
};
absl::StatusOr<ReshardedRecords> ReadReshardedJournals(
    const std::string& dir, const layercast::v1::JournalIdentity& identity, const ModelSpec& model,
    uint32_t from_count, const std::vector<uint32_t>& from_shards,
    FileSystem& fs = DefaultFileSystem());

}  // namespace layercast::server
