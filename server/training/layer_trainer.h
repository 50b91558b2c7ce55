#pragma once

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/optimizer.h"
#include "core/optimizer_spec.h"
#include "server/checkpoints/checkpoint_source.h"
#include "server/checkpoints/checkpoint_state.h"
#include "server/checkpoints/checkpoint_writer.h"
#include "server/serving/change_log.h"
#include "server/serving/memory_budget.h"
#include "server/serving/parameter_store.h"
#include "server/serving/version_gate.h"
#include "server/training/push_journal.h"
#include "server/training/staging_pool.h"
#include "server/versions/pinned_versions.h"
#include "server/versions/versioned_master.h"

namespace layercast::server {

// What a LayerTrainer keeps in step with; each must outlive it. Any may be
// null (in unit tests).
struct TrainerLinks {
  // The only holder of each layer's version: the trainer reads it, and
  // steps advance it. Null: the trainer keeps a gate of its own.
  VersionGate* gate = nullptr;
  MemoryBudget* budget = nullptr;    // where staged pushes are charged
  ChangeLog* changes = nullptr;      // told what each step changed
  PinnedVersions* pinned = nullptr;  // keeps what each step replaced, for pinned readers
};

// One shard's training state: for every layer, its version (steps applied
// to it), the gradients pushed for its current step, one per data-parallel
// worker, and the optimizer state of the shard's slice of each tensor, in
// fp32. A layer's step is applied when all W workers' gradients for it are
// in, so the update of one layer overlaps the backward pass of the layers
// below it:
//
//   mean = (g_0 + g_1 + ... + g_{W-1}) / W
//
// summed left to right in worker order in fp32, then divided by W (true
// division, as torch's `sum.div_(W)`), whatever order the pushes arrived in:
// early arrivals wait, staged, for the workers before them. Then the
// optimizer (core/optimizer.h, bit for bit torch's) steps the fp32 master
// with the learning rate of step version + 1, and the version advances.
//
// Exactly once: a second push of the same (step, worker, layer) is
// ALREADY_EXISTS, whether its step is still open or already applied, so a
// worker retrying after an ambiguous failure changes nothing.
//
// A step holds the layer's ParameterStore::layer_mutex exclusively while
// it changes the master and advances the layer in the VersionGate, so a
// reader holding it shared sees the master and the version agree.
//
// Memory: a layer step's staging (one float per owned element for each of
// the W pushes) is reserved from the budget whole, once, for the step
// (ReserveStep): every push of the step waits for that one reservation, so
// a step that has begun can always complete, however many pushes of other
// steps wait for budget. The step returns it as it applies (with clipping,
// the mean's share when the scale arrives) to a StagingPool, which keeps
// the buffers, still charged, for the next step of a layer of that size
// (spare_staging(): drained when the budget needs room).
//
// Thread-safe; pushes to different layers proceed in parallel.
class LayerTrainer {
 public:
  using Links = TrainerLinks;

  // `store` must outlive the trainer; its master is what the steps update.
  // INVALID_ARGUMENT for workers == 0; RESOURCE_EXHAUSTED when the
  // optimizer state cannot be allocated.
  static absl::StatusOr<std::unique_ptr<LayerTrainer>> Create(ParameterStore& store,
                                                              OptimizerSpec spec, uint32_t workers,
                                                              Links links = {});

  // Bytes of optimizer state held for the whole model on this shard
  // (AdamW: twice the master; SGD with momentum: once; plain SGD: none).
  static uint64_t StateBytes(const ParameterStore& store, const OptimizerSpec& spec);

  // What training adds to shard `shard_index` of `num_shards`'s memory,
  // known before its parameters load (the start-up check): the optimizer
  // state, and the staging of one step of its largest layer, one push per
  // worker. Saturates at UINT64_MAX rather than wrapping.
  struct Memory {
    uint64_t state_bytes = 0;
    uint64_t step_staging_bytes = 0;
  };
  // With clip=, every layer's mean is held until the scale arrives: one
  // more fp32 copy of the slice, counted in step_staging_bytes.
  static Memory MemoryFor(const ModelSpec& model, uint32_t shard_index, uint32_t num_shards,
                          const OptimizerSpec& spec, uint32_t workers);

  struct Pushed {
    uint64_t layer_version;        // after this push
    bool applied;                  // this push completed the layer's step
    double optimizer_seconds = 0;  // the step's, when applied
    double step_seconds = 0;       // since the step's first push, when applied
  };

  // One admitted push stream, from AdmitPush until it goes: it holds its
  // (step, worker, layer) in flight, asks for the step's staging, and
  // stages the push and hands it to the trainer. Its destructor ends the
  // push (EndPush), keeping an untaken staging buffer for the step's next
  // push. Not thread-safe, but for CancelWait (see its comment).
  using ReservationReady = std::function<void(bool granted)>;
  class PushTicket {
   public:
    PushTicket(PushTicket&& other) noexcept;
    PushTicket& operator=(PushTicket&&) = delete;
    ~PushTicket();

    uint32_t layer() const { return layer_; }
    // ReserveStep for this push's step; `ready` may run on this thread
    // before it returns (the staging is reserved already).
    uint64_t Reserve(std::chrono::steady_clock::time_point give_up_at, ReservationReady ready);
    // CancelReservationWait: true if wait `id` was still waiting. May be
    // called from another thread while the push waits.
    bool CancelWait(uint64_t id);
    // The push's staging buffer, once Reserve's `ready(true)` ran;
    // RESOURCE_EXHAUSTED when memory runs out.
    absl::StatusOr<std::span<float>> Stage();
    // Hands the staged push to the trainer (Push).
    absl::StatusOr<Pushed> Push();

   private:
    friend class LayerTrainer;
    PushTicket(LayerTrainer& trainer, uint32_t layer, uint32_t worker, uint64_t step)
        : trainer_(&trainer), layer_(layer), worker_(worker), step_(step) {}

    LayerTrainer* trainer_;  // null once moved from
    uint32_t layer_, worker_;
    uint64_t step_;
    std::vector<float> staging_;
  };

  // The one call that admits a push stream of (layer, worker, step): the
  // checks of BeginPush, and RESOURCE_EXHAUSTED when the step's staging
  // (StepBytes) could never fit the budget beside the master and optimizer
  // state. Nothing is staged yet.
  absl::StatusOr<PushTicket> AdmitPush(uint32_t layer, uint32_t worker, uint64_t step);

  // Admits one push stream of (layer, worker, step) before anything is
  // staged: the error Push would return now, or ABORTED while another
  // stream of the same (step, worker, layer) is in flight (a second would
  // stage the layer slice again, outside the step's reservation). OK marks
  // it in flight until EndPush. REQUIRES for an OK answer: EndPush follows.
  absl::Status BeginPush(uint32_t layer, uint32_t worker, uint64_t step);
  // The stream BeginPush admitted has ended, taken by Push or not;
  // `unused` is its staging if Push did not take it (empty otherwise),
  // kept for the step's next push while the step's reservation holds it.
  void EndPush(uint32_t layer, uint32_t worker, uint64_t step, std::vector<float> unused);
  // Takes worker `worker`'s gradient of `layer` computed at version `step`:
  // the shard's owned elements of every tensor, back to back in tensor
  // order, widened to fp32 (as wire::GradientDecoder stages them).
  //   NOT_FOUND            no such layer;
  //   INVALID_ARGUMENT     worker >= workers, or the wrong number of values;
  //   FAILED_PRECONDITION  step is ahead of the layer's version (naming both);
  //   ALREADY_EXISTS       this (step, worker, layer) was pushed already.
  absl::StatusOr<Pushed> Push(uint32_t layer, uint32_t worker, uint64_t step,
                              std::vector<float> gradient);

  // REQUIRES for the three below: layer < the model's layers.
  // Elements of `layer` this shard owns: the size a push must have.
  uint64_t owned_elements(uint32_t layer) const { return layers_[layer]->owned_elements; }
  // Bytes of one staged push of `layer`, and of a whole step's (W pushes).
  uint64_t StagingBytes(uint32_t layer) const { return owned_elements(layer) * sizeof(float); }
  uint64_t StepBytes(uint32_t layer) const { return workers_ * StagingBytes(layer); }
  // A buffer for one push of `layer`'s current step: one the step's
  // reservation claimed from the pool, else a new one. Contents
  // unspecified. Throws std::bad_alloc when memory runs out.
  std::vector<float> TakeStaging(uint32_t layer);
  // The pooled staging of applied steps, for the budget's reclaimer to
  // drain (held weakly: the reclaimer may outlive the trainer).
  std::weak_ptr<StagingPool> spare_staging() const { return pool_; }
  // Calls `ready(true)` once `step` of `layer` has its staging reserved:
  // inline, on this thread, when it has already (or `step` is not the
  // layer's current step: the push will be refused), and returns 0; else
  // the first caller asks the budget for StepBytes and every caller of the
  // step waits for that one grant, which calls each `ready` on the budget's
  // grant executor, or `ready(false)` at the first caller's `give_up_at`.
  // Returns an id for CancelReservationWait. REQUIRES: layer < layers.
  uint64_t ReserveStep(uint32_t layer, uint64_t step,
                       std::chrono::steady_clock::time_point give_up_at, ReservationReady ready);
  // Withdraws wait `id`: true if it was still waiting (its `ready` will never
  // run); the last waiter withdrawn withdraws the budget request too.
  bool CancelReservationWait(uint32_t layer, uint64_t id);
  uint64_t version(uint32_t layer) const;
  // Workers whose push for `layer`'s current step has not arrived.
  uint32_t missing_workers(uint32_t layer) const;
  // What `layer`'s current step waits for, in words naming the workers
  // that have not pushed (for a reader waiting for the next version).
  // Never waits: a layer whose step is being applied says so.
  std::string WaitingFor(uint32_t layer) const;
  uint32_t workers() const { return workers_; }
  const OptimizerSpec& spec() const { return spec_; }

  // Runs `write` with every layer's steps paused (a push arriving meanwhile
  // waits) and this trainer's state as CheckpointExtras: the spec, every
  // layer's version and step count, and every optimizer state buffer
  // (checkpoint_format.h). `version` is the model's, its lowest layer's.
  // What checkpoints of a training shard are written through.
  using CheckpointWrite = absl::FunctionRef<absl::StatusOr<CheckpointInfo>(
      uint64_t version, const CheckpointExtras& extras)>;
  absl::StatusOr<CheckpointInfo> WriteWithState(CheckpointWrite write);

  // Takes back what a checkpoint saved: every layer's version and step
  // count, every state buffer, and the pushes staged for open steps (their
  // staging charged to the budget again), read from `source`. Before any
  // push. RESOURCE_EXHAUSTED when the open steps' staging no longer fits.
  // FAILED_PRECONDITION when the checkpoint was trained with another kind
  // of optimizer, or with state this spec does not keep.
  // `source` may be a resharded one: its state is this shard's either way.
  absl::Status Restore(const CheckpointState& source);

  // Takes again what `journal` holds (after Restore, before any push): each
  // push as Push takes it, each clip scale as ApplyClippedStep, skipping
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
  // (the journals of another shard count: server/training/journal_reshard.h), in
  // the order given.
  absl::StatusOr<Replayed> Replay(std::vector<PushJournal::Record> records);
  // From now on every push and clip scale is appended to `journal` before
  // it is taken (the shard answers a push after Push returns); each
  // checkpoint starts a new generation and retires what it holds. Before
  // any push; `journal` must outlive the trainer.
  void JournalTo(PushJournal& journal) { journal_ = &journal; }

  // Global gradient-norm clipping (a spec with clip=). A layer whose W
  // pushes are in is reduced to its mean, which is held (one fp32 value per
  // owned element, the gradient accumulator) until ApplyClippedStep: every
  // layer of a step must be reduced on every shard before the norm is known.
  struct StepNorm {
    bool ready = false;                    // every layer of the step is reduced
    double sum_of_squares = 0;             // of this shard's mean gradient, fp64
    std::vector<uint32_t> waiting_layers;  // still missing pushes
    double max_norm = 0;                   // the spec's clip=, 0 without clipping
    std::optional<float> applied_scale;    // the step was applied with it
  };
  StepNorm NormOfStep(uint64_t step) const;
  // Multiplies every layer's held mean by `scale` (ClipScale of the global
  // norm) and steps its optimizer; returns the model's new version. A step
  // applied already answers the same. FAILED_PRECONDITION without clipping
  // or while a layer still waits for pushes; INVALID_ARGUMENT for a scale
  // outside [0, 1] (a NaN norm), changing nothing.
  absl::StatusOr<uint64_t> ApplyClippedStep(uint64_t step, float scale);

  // Live hand-over to a set of another size (ShardAdmin.HandOver,
  // docs/decisions.md): from now on every push for a step at or after
  // `version` is refused (FAILED_PRECONDITION, telling the worker to move to
  // the new set), so the state stops changing once every layer reaches it.
  // FAILED_PRECONDITION, freezing nothing, when a layer is past `version` or
  // its step `version` has begun, or when frozen at another version.
  absl::Status Freeze(uint64_t version);
  // Takes pushes again (the hand-over was abandoned).
  void Unfreeze() { frozen_at_.store(kNoPush); }
  std::optional<uint64_t> frozen_at() const;
  // Frozen, and every layer at frozen_at() with no push staged or in flight:
  // the state is one consistent cut, and stays so.
  bool AtFrozenBoundary() const;
  // What a checkpoint written now would hold as its training header (no
  // staged pushes: it is meant for a frozen trainer).
  CheckpointTraining TrainingHeader() const;
  // Elements `range` of tensor `tensor` of `layer`: its master (`buffer`
  // empty) or its optimizer state buffer `buffer`, into `dst`.
  // FAILED_PRECONDITION unless AtFrozenBoundary(); OUT_OF_RANGE for a range
  // outside this shard's slice; NOT_FOUND for no such tensor or buffer.
  absl::Status ReadFrozen(uint32_t layer, uint32_t tensor, const std::string& buffer,
                          ElementRange range, std::span<float> dst) const;

  // The layer step that has waited longest for its last push: its missing
  // workers and the seconds since its first push; {0, 0} when every layer's
  // step is either complete or not yet begun.
  struct OpenStep {
    uint32_t missing_workers = 0;
    double waited_seconds = 0;
  };
  OpenStep OldestOpenStep() const;

 private:
  static constexpr uint64_t kNoPush = UINT64_MAX;
  struct LayerState {
    mutable absl::Mutex mu;
    uint32_t index = 0;  // the layer's
    uint64_t owned_elements = 0;
    // Per worker, its gradient for the step at the layer's version (in the
    // gate), until the step applies.
    std::vector<std::optional<std::vector<float>>> pushed ABSL_GUARDED_BY(mu);
    // Per worker, the step its push stream in flight is for (BeginPush to
    // EndPush); kNoPush when none is.
    std::vector<uint64_t> in_flight ABSL_GUARDED_BY(mu);
    // Every worker pushed and pushed[0] holds the mean (clipping: it waits
    // for the scale), with the sum of its squares.
    bool reduced ABSL_GUARDED_BY(mu) = false;
    // The current step's staging: reserved (StepBytes, from the budget),
    // being asked for (budget_wait, with the pushes waiting for it), or not.
    bool reserved ABSL_GUARDED_BY(mu) = false;
    uint64_t budget_wait ABSL_GUARDED_BY(mu) = 0;
    std::map<uint64_t, ReservationReady> waiting ABSL_GUARDED_BY(mu);
    // Pooled buffers the step's reservation claimed, for its pushes; empty
    // unless `reserved`.
    std::vector<std::vector<float>> spare ABSL_GUARDED_BY(mu);
    double sum_of_squares ABSL_GUARDED_BY(mu) = 0;
    // When the current step's first push arrived; nullopt before it.
    std::optional<std::chrono::steady_clock::time_point> opened ABSL_GUARDED_BY(mu);
    std::vector<TensorOptimizer> optimizers ABSL_GUARDED_BY(mu);  // per tensor
  };

  // A gate for a trainer linked to none; its grants are never run (the
  // trainer waits on no version).
  struct OwnGate {
    boost::asio::io_context grants;
    VersionGate gate{grants.get_executor()};
  };

  LayerTrainer(ParameterStore& store, OptimizerSpec spec, uint32_t workers, Links links,
               uint64_t pool_bytes, std::unique_ptr<OwnGate> own_gate)
      : store_(store),
        spec_(std::move(spec)),
        workers_(workers),
        own_gate_(std::move(own_gate)),
        links_(links),
        master_({.store = &store,
                 .gate = links.gate,
                 .changes = links.changes,
                 .pinned = links.pinned}),
        pool_(std::make_shared<StagingPool>(pool_bytes, links.budget)) {}

  // Workers whose push the layer's current step still waits for.
  static uint32_t MissingLocked(const LayerState& state) ABSL_SHARED_LOCKS_REQUIRED(state.mu);
  // BeginPush's checks of the step. REQUIRES: layer < layers, worker < workers.
  absl::Status CheckStepLocked(uint32_t layer, uint32_t worker, uint64_t step,
                               const LayerState& state) const ABSL_SHARED_LOCKS_REQUIRED(state.mu);
  // NOT_FOUND / INVALID_ARGUMENT for a layer or worker out of range.
  absl::Status CheckIndices(uint32_t layer, uint32_t worker) const;

  // Reserves `layer`'s current step from pooled buffers of its size, topped
  // up from the budget if it has the rest free now; false (taking nothing)
  // otherwise, or while a request waits for budget.
  bool ReserveFromPoolLocked(uint32_t layer, LayerState& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // A staging buffer charged to the step's reservation goes to the pool
  // with its charge; one that is not (no reservation: unit tests) is freed.
  void RecycleLocked(LayerState& state, std::vector<float> buffer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // The mean's sum of squares in fp64, in element order (clipping's norm).
  static double SumOfSquares(const std::vector<float>& mean);
  // Push's part once the step is checked: stages `gradient`, and reduces
  // or applies the step when it was the last push.
  absl::StatusOr<Pushed> TakeLocked(uint32_t layer, uint32_t worker, LayerState& state,
                                    std::vector<float> gradient)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // Charges the open step's staging to the budget if nothing has yet
  // (restored or replayed pushes, which no reservation brought).
  absl::Status ChargeRestoredLocked(uint32_t layer, LayerState& state, uint64_t bytes,
                                    absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // Replay's part for one record of either kind.
  absl::Status ReplayRecord(PushJournal::Record record, Replayed& replayed);
  // Replay's part for one push record.
  absl::Status ReplayPushLocked(PushJournal::Record record, LayerState& state, Replayed& replayed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // Restore's part for `layer`: the pushes of its open step, staged again.
  absl::Status RestoreStagedLocked(const CheckpointState& source, const CheckpointTraining& saved,
                                   uint32_t layer, LayerState& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // Averages the staged gradients into pushed[0], in worker order, and
  // recycles the other workers' staging.
  void ReduceLocked(LayerState& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);
  // Reduces (if not yet), scales the mean by `clip_scale` if given, and
  // steps the optimizer on the master.
  absl::Status ApplyLocked(uint32_t layer, LayerState& state, std::optional<float> clip_scale)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu);

  // Layer `state`'s version: its step's number, less one.
  uint64_t VersionLocked(const LayerState& state) const ABSL_SHARED_LOCKS_REQUIRED(state.mu) {
    return links_.gate->version(state.index);
  }

  ParameterStore& store_;
  const OptimizerSpec spec_;
  const uint32_t workers_;
  const std::unique_ptr<OwnGate> own_gate_;  // before links_, which points at it
  const Links links_;                        // its gate is never null
  VersionedMaster master_;                   // how a step changes each layer
  std::vector<std::unique_ptr<LayerState>> layers_;
  const std::shared_ptr<StagingPool> pool_;
  // The budget's answer to layer `layer`'s reservation request.
  void OnReservation(uint32_t layer, bool granted);

  std::atomic<uint64_t> next_wait_id_{1};
  // Pushes for steps at or after it are refused (Freeze); kNoPush: none.
  std::atomic<uint64_t> frozen_at_{kNoPush};
  PushJournal* journal_ = nullptr;  // set before any push
  // Serialises clipped steps; the last one applied and its scale.
  mutable absl::Mutex clip_mu_;
  std::optional<std::pair<uint64_t, float>> last_clip_ ABSL_GUARDED_BY(clip_mu_);
};

}  // namespace layercast::server
