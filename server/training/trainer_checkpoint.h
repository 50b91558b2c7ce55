#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "server/checkpoints/checkpoint_source.h"
#include "server/checkpoints/checkpoint_state.h"
#include "server/checkpoints/checkpoint_writer.h"
#include "server/training/push_journal.h"
#include "server/training/push_staging.h"
#include "server/training/trainer_clip.h"
#include "server/training/trainer_layers.h"
#include "server/training/trainer_steps.h"

namespace layercast::server {

// The trainer's durability: the state its checkpoints hold (every layer's
// version and step count, every optimizer state buffer, the pushes staged
// for open steps, the last clip), taking that back, and replaying the push
// journal over it. Thread-safe.
class TrainerCheckpoint {
 public:
  // Each must outlive this.
  TrainerCheckpoint(TrainerLayers& layers, PushStaging& staging, TrainerSteps& steps,
                    TrainerClip& clip)
      : layers_(layers), staging_(staging), steps_(steps), clip_(clip) {}

  // Runs `write` with every layer's steps paused (a push arriving meanwhile
  // waits) and this trainer's state as CheckpointExtras: the spec, every
  // layer's version and step count, and every optimizer state buffer
  // (checkpoint_format.h). `version` is the model's, its lowest layer's.
  // What checkpoints of a training shard are written through. With a
  // journal, starts its new generation and, once written, retires the
  // older ones.
  using Write = absl::FunctionRef<absl::StatusOr<CheckpointInfo>(uint64_t version,
                                                                 const CheckpointExtras& extras)>;
  absl::StatusOr<CheckpointInfo> WriteWithState(Write write);

  // What a checkpoint written now would hold as its training header (no
  // staged pushes: it is meant for a frozen trainer).
  CheckpointTraining TrainingHeader() const;

  // Takes back what a checkpoint saved: every layer's version and step
  // count, every state buffer, and the pushes staged for open steps (their
  // staging charged to the budget again), read from `source`. Before any
  // push. RESOURCE_EXHAUSTED when the open steps' staging no longer fits.
  // FAILED_PRECONDITION when the checkpoint was trained with another kind
  // of optimizer, or with state this spec does not keep.
  // `source` may be a resharded one: its state is this shard's either way.
  absl::Status Restore(const CheckpointState& source);

  // Takes again what `journal` holds (after Restore, before any push): each
  // push as a push is taken, each clip scale as ApplyClippedStep, skipping
  // those the checkpoint holds already. The open steps' staging is charged
  // to the budget: RESOURCE_EXHAUSTED when it no longer fits.
  // FAILED_PRECONDITION for a push ahead of its layer (a journal that does
  // not follow the checkpoint restored). Damage in the journal: as
  // PushJournal::Replay says under `on_damage`.
  struct Replayed {
    uint64_t taken = 0;                         // pushes and scales taken again
    uint64_t skipped = 0;                       // held by the checkpoint already
    uint64_t steps = 0;                         // layer steps they applied
    std::optional<PushJournal::Damage> damage;  // accepted (OnDamage::kAccept)
  };
  absl::StatusOr<Replayed> Replay(PushJournal& journal,
                                  PushJournal::OnDamage on_damage = PushJournal::OnDamage::kRefuse);
  // As Replay, for records already read and cut to this shard's elements
  // (the journals of another shard count: server/training/journal_reshard.h),
  // in the order given.
  absl::StatusOr<Replayed> Replay(std::vector<PushJournal::Record> records);
  // From now on every push and clip scale is appended to `journal` before
  // it is taken (the shard answers a push after it is); each checkpoint
  // starts a new generation and retires what it holds. Before any push;
  // `journal` must outlive the trainer.
  void JournalTo(PushJournal& journal) { steps_.JournalTo(journal); }

 private:
  // Replay's part for one record of either kind.
  absl::Status ReplayRecord(PushJournal::Record record, Replayed& replayed);
  // Replay's part for one push record.
  absl::Status ReplayPushLocked(PushJournal::Record record, TrainerLayers::Layer& state,
                                Replayed& replayed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // Restore's part for `layer`: the pushes of its open step, staged again.
  absl::Status RestoreStagedLocked(const CheckpointState& source, const CheckpointTraining& saved,
                                   uint32_t layer, TrainerLayers::Layer& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

  TrainerLayers& layers_;
  PushStaging& staging_;
  TrainerSteps& steps_;
  TrainerClip& clip_;
};

}  // namespace layercast::server
