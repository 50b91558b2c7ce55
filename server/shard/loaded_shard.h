#pragma once

#include <memory>

#include "server/casting/cast_cache.h"
#include "server/casting/layer_digests.h"
#include "server/publishing/publication.h"
#include "server/serving/change_log.h"
#include "server/serving/chunk_pool.h"
#include "server/serving/memory_budget.h"
#include "server/serving/parameter_store.h"
#include "server/serving/shared_chunks.h"
#include "server/training/layer_trainer.h"
#include "server/training/periodic_checkpoints.h"
#include "server/training/push_journal.h"
#include "server/versions/pinned_versions.h"

namespace layercast::server {

// Everything a shard serves from once its parameters are loaded, built by
// ShardServer::Load and handed to the services whole, and destroyed as one
// unit. The members are in the order Load builds them, so each goes before
// what it uses: the periodic checkpoints stop before the trainer and store
// they write; the cast chunks, the trainer's staging and the versions kept
// for pinned readers give their bytes back before the budget goes.
//
// Null members are what the shard's flags leave out; the store and the
// budget are always set.
struct LoadedShard {
  LoadedShard() = default;
  // Stops the budget's reclaimer first: one running on the timer thread
  // could hold the last reference to what it reclaims while the members go.
  ~LoadedShard() {
    if (budget != nullptr) budget->SetReclaimer({});
  }
  LoadedShard(const LoadedShard&) = delete;
  LoadedShard& operator=(const LoadedShard&) = delete;

  std::unique_ptr<ParameterStore> store;
  std::unique_ptr<MemoryBudget> budget;
  // Which values each of the last --delta-versions changed; null with 0.
  std::unique_ptr<ChangeLog> changes;
  // Versions kept for pinned readers; null with --pin-retention-ms 0 or
  // --delta-versions 0. Shared with the budget's reclaimer, which holds it
  // weakly.
  std::shared_ptr<PinnedVersions> pinned;
  // Every push the trainer takes, until a checkpoint holds it
  // (--push-journal).
  std::unique_ptr<PushJournal> journal;
  // Null without --optimizer.
  std::unique_ptr<LayerTrainer> trainer;
  // A read-only shard's publishes; null on a training shard.
  std::unique_ptr<Publications> publications;
  // The buffers chunks are cast into; before `shared`, whose kept chunks
  // give theirs back as they go. Shared with the budget's reclaimer, which
  // holds it weakly.
  std::shared_ptr<ChunkPool> pool;
  // A read-only shard's cast cache; null without --cast-cache-bytes. Before
  // `shared`, whose kept chunks may be slices of it. Shared with the
  // budget's reclaimer, which holds it weakly.
  std::shared_ptr<CastCache> cast_cache;
  // Cast chunks kept for other streams; null with --shared-chunk-bytes 0.
  // Shared with the budget's reclaimer, which holds it weakly.
  std::shared_ptr<SharedChunks> shared;
  // --checkpoint-every; null without it.
  std::unique_ptr<PeriodicCheckpoints> periodic_checkpoints;
  // GetLayerDigest's: last, so that its DeadlineTimers on the shard's
  // background thread stops (waits for the digest under way, drops the
  // rest) before what it reads goes.
  std::unique_ptr<LayerDigests> digests;
};

}  // namespace layercast::server
