#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/optimizer.h"
#include "core/optimizer_spec.h"
#include "server/serving/change_log.h"
#include "server/serving/memory_budget.h"
#include "server/serving/parameter_store.h"
#include "server/serving/version_gate.h"
#include "server/versions/pinned_versions.h"

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

// What every part of a LayerTrainer shares: per layer, what its current
// step holds, under the layer's mutex, and the rules that say whether a
// push belongs to that step; and what each layer's step waits for. The
// parts (PushStaging, TrainerSteps, TrainerClip, TrainerCheckpoint,
// TrainerHandOver) each change it in their own way.
//
// Lock order: all_mu, then layers in index order. Thread-safe.
class TrainerLayers {
 public:
  static constexpr uint64_t kNoPush = UINT64_MAX;
  using ReservationReady = std::function<void(bool granted)>;

  struct Layer {
    mutable absl::Mutex mu;
    uint32_t index = 0;  // the layer's
    uint64_t owned_elements = 0;
    // Per worker, its gradient for the step at the layer's version (in the
    // gate), until the step applies.
    std::vector<std::optional<std::vector<float>>> pushed ABSL_GUARDED_BY(mu);
    // Per worker, the step its push stream in flight is for (from its
    // admission until its ticket goes); kNoPush when none is.
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

  // `links.gate` must not be null. No layers until AddLayers.
  TrainerLayers(ParameterStore& store, OptimizerSpec spec, uint32_t workers, TrainerLinks links)
      : store_(store), spec_(std::move(spec)), workers_(workers), links_(links) {}

  // One Layer per layer of the store's model, with its optimizer state.
  // Throws std::bad_alloc when the state cannot be allocated.
  void AddLayers();

  ParameterStore& store() const { return store_; }
  const OptimizerSpec& spec() const { return spec_; }
  uint32_t workers() const { return workers_; }
  const TrainerLinks& links() const { return links_; }
  uint32_t size() const { return static_cast<uint32_t>(layers_.size()); }
  // REQUIRES: layer < size().
  Layer& layer(uint32_t layer) { return *layers_[layer]; }
  const Layer& layer(uint32_t layer) const { return *layers_[layer]; }
  // Elements of `layer` this shard owns: the size a push must have.
  uint64_t owned_elements(uint32_t layer) const { return layers_[layer]->owned_elements; }

  // Held by what works on every layer at once (a clipped step, a
  // checkpoint, a freeze), before any layer's lock.
  absl::Mutex& all_mu() const ABSL_LOCK_RETURNED(all_mu_) { return all_mu_; }
  // Every layer's lock, after all_mu: no push is between its check and its
  // staging while it is held.
  class Paused {
   public:
    explicit Paused(const TrainerLayers& layers);

   private:
    absl::MutexLock all_;
    std::vector<std::unique_ptr<absl::MutexLock>> layers_;
  };

  // Layer `state`'s version: its step's number, less one.
  uint64_t VersionLocked(const Layer& state) const ABSL_SHARED_LOCKS_REQUIRED(state.mu) {
    return links_.gate->version(state.index);
  }
  uint64_t version(uint32_t layer) const { return links_.gate->version(layer); }

  // Pushes for steps at or after it are refused (TrainerHandOver::Freeze);
  // kNoPush: none.
  uint64_t frozen_at() const { return frozen_at_.load(); }
  void set_frozen_at(uint64_t version) { frozen_at_.store(version); }

  // NOT_FOUND / INVALID_ARGUMENT for a layer or worker out of range.
  absl::Status CheckIndices(uint32_t layer, uint32_t worker) const;
  // Whether a push of (layer, worker, step) belongs to the layer's current
  // step: FAILED_PRECONDITION while frozen at or before `step`, or for a
  // step ahead of the layer's version (naming both); ALREADY_EXISTS for an
  // applied step, or a worker that pushed this one. REQUIRES: layer <
  // size(), worker < workers().
  absl::Status CheckStepLocked(uint32_t layer, uint32_t worker, uint64_t step,
                               const Layer& state) const ABSL_SHARED_LOCKS_REQUIRED(state.mu);

  // Workers whose push the layer's current step still waits for.
  static uint32_t MissingLocked(const Layer& state) ABSL_SHARED_LOCKS_REQUIRED(state.mu);
  // REQUIRES for the two below: layer < size().
  uint32_t missing_workers(uint32_t layer) const;
  // What `layer`'s current step waits for, in words naming the workers
  // that have not pushed (for a reader waiting for the next version).
  // Never waits: a layer whose step is being applied says so.
  std::string WaitingFor(uint32_t layer) const;

  // The layer step that has waited longest for its last push: its missing
  // workers and the seconds since its first push; {0, 0} when every layer's
  // step is either complete or not yet begun.
  struct OpenStep {
    uint32_t missing_workers = 0;
    double waited_seconds = 0;
  };
  OpenStep OldestOpenStep() const;

 private:
  ParameterStore& store_;
  const OptimizerSpec spec_;
  const uint32_t workers_;
  const TrainerLinks links_;
  mutable absl::Mutex all_mu_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::atomic<uint64_t> frozen_at_{kNoPush};
};

}  // namespace layercast::server
