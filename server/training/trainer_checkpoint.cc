#include "server/training/trainer_checkpoint.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"

namespace layercast::server {

absl::StatusOr<CheckpointInfo> TrainerCheckpoint::WriteWithState(Write write)
    ABSL_NO_THREAD_SAFETY_ANALYSIS {  // holds every layer's lock, which the analysis cannot follow
  // Not in the middle of a clipped step, which moves every layer: all_mu
  // first, as ApplyClippedStep takes it.
  const TrainerLayers::Paused paused(layers_);
  CheckpointExtras extras;
  std::vector<std::string> versions, steps, staged;
  uint64_t version = UINT64_MAX;
  const ModelSpec& model = layers_.store().model();
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const TrainerLayers::Layer& state = layers_.layer(l);
    version = std::min(version, layers_.VersionLocked(state));
    versions.push_back(absl::StrCat(layers_.VersionLocked(state)));
    steps.push_back(absl::StrCat(state.optimizers.empty() ? 0 : state.optimizers[0].steps()));
    for (uint32_t t = 0; t < state.optimizers.size(); ++t) {
      for (const auto& [buffer, values] : state.optimizers[t].StateBuffers()) {
        extras.tensors.emplace_back(OptimizerStateName(buffer, model.layers[l].tensors[t].name),
                                    values);
      }
    }
    // The open step's pushes, so that a shard stopped mid-step completes it.
    for (uint32_t w = 0; w < layers_.workers(); ++w) {
      if (!state.pushed[w]) continue;
      const std::string part = state.reduced ? kStagedMean : absl::StrCat(w);
      staged.push_back(absl::StrCat(l, "/", part));
      extras.tensors.emplace_back(StagedPushName(l, part), *state.pushed[w]);
    }
  }
  extras.metadata = {{"optimizer", layers_.spec().ToString()},
                     {"layer_versions", absl::StrJoin(versions, ",")},
                     {"optimizer_steps", absl::StrJoin(steps, ",")},
                     {"staged_pushes", absl::StrJoin(staged, ",")},
                     {"data_parallel_workers", absl::StrCat(layers_.workers())}};
  // The last clipped step and its scale's bits, so that a restarted shard
  // reports (and keeps) the scale it applied.
  if (const auto last_clip = clip_.last_clip_locked()) {
    extras.metadata.emplace("last_clip", absl::StrCat(last_clip->first, ",",
                                                      std::bit_cast<uint32_t>(last_clip->second)));
  }
  // Everything the journal holds so far is in this checkpoint (no push is
  // between its record and its step while the locks are held): once the
  // file is durable, those generations go.
  const uint64_t generation = steps_.journal() != nullptr ? steps_.journal()->Rotate(version) : 0;
  absl::StatusOr<CheckpointInfo> written = write(version, extras);
  if (written.ok() && steps_.journal() != nullptr) steps_.journal()->Retire(generation);
  return written;
}

CheckpointTraining TrainerCheckpoint::TrainingHeader() const {
  CheckpointTraining header;
  header.optimizer = layers_.spec().ToString();
  header.workers = layers_.workers();
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const TrainerLayers::Layer& layer = layers_.layer(l);
    absl::MutexLock lock(&layer.mu);
    header.layer_versions.push_back(layers_.VersionLocked(layer));
    header.optimizer_steps.push_back(layer.optimizers.empty() ? 0 : layer.optimizers[0].steps());
  }
  header.last_clip = clip_.last_clip();
  return header;
}

absl::StatusOr<TrainerCheckpoint::Replayed> TrainerCheckpoint::Replay(
    PushJournal& journal, PushJournal::OnDamage on_damage) {
  Replayed replayed;
  ASSIGN_OR_RETURN(const PushJournal::Replayed read,
                   journal.Replay(
                       [&](PushJournal::Record record) -> absl::Status {
                         return ReplayRecord(std::move(record), replayed);
                       },
                       on_damage));
  replayed.damage = read.damage;
  return replayed;
}

absl::StatusOr<TrainerCheckpoint::Replayed> TrainerCheckpoint::Replay(
    std::vector<PushJournal::Record> records) {
  Replayed replayed;
  for (PushJournal::Record& record : records) {
    RETURN_IF_ERROR(ReplayRecord(std::move(record), replayed));
  }
  return replayed;
}

absl::Status TrainerCheckpoint::ReplayRecord(PushJournal::Record record, Replayed& replayed) {
  if (record.kind == PushJournal::Record::Kind::kClipScale) {
    if (record.values.size() != 1) {
      return absl::DataLossError("a clip-scale record without one scale");
    }
    uint64_t lowest = UINT64_MAX;
    for (uint32_t l = 0; l < layers_.size(); ++l) {
      lowest = std::min(lowest, layers_.version(l));
    }
    if (lowest > record.step) {
      ++replayed.skipped;  // every layer applied it before the checkpoint
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(clip_.ApplyClippedStep(record.step, record.values[0]).status());
    ++replayed.taken;
    replayed.steps += layers_.size();
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(layers_.CheckIndices(record.layer, record.worker));
  TrainerLayers::Layer& state = layers_.layer(record.layer);
  absl::MutexLock lock(&state.mu);
  return ReplayPushLocked(std::move(record), state, replayed);
}

absl::Status TrainerCheckpoint::ReplayPushLocked(PushJournal::Record record,
                                                 TrainerLayers::Layer& state, Replayed& replayed) {
  const uint32_t layer = record.layer;
  if (record.values.size() != state.owned_elements) {
    return absl::DataLossError(absl::StrCat("a journaled push of ", record.values.size(),
                                            " values for layer ", layer, ", which owns ",
                                            state.owned_elements));
  }
  const absl::Status checked = layers_.CheckStepLocked(layer, record.worker, record.step, state);
  if (absl::IsAlreadyExists(checked)) {
    ++replayed.skipped;  // in the checkpoint already
    return absl::OkStatus();
  }
  if (!checked.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the push journal does not follow the checkpoint restored (", checked.message(),
        "): it holds steps the checkpoint lacks. Restore the checkpoint written with it, or "
        "remove the journal files (losing the pushes they hold)"));
  }
  RETURN_IF_ERROR(
      staging_.ChargeRestoredLocked(layer, state, staging_.StepBytes(layer), "the push journal"));
  ASSIGN_OR_RETURN(const TrainerSteps::Pushed pushed,
                   steps_.TakeLocked(layer, record.worker, state, std::move(record.values)));
  ++replayed.taken;
  if (pushed.applied) ++replayed.steps;
  return absl::OkStatus();
}

absl::Status TrainerCheckpoint::Restore(const CheckpointState& source) {
  const std::optional<CheckpointTraining>& saved = source.training();
  if (!saved) return absl::OkStatus();
  clip_.set_last_clip(saved->last_clip);
  ASSIGN_OR_RETURN(const OptimizerSpec saved_spec, OptimizerSpec::Parse(saved->optimizer));
  const ModelSpec& model = layers_.store().model();
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    TrainerLayers::Layer& state = layers_.layer(l);
    absl::MutexLock lock(&state.mu);
    for (uint32_t t = 0; t < state.optimizers.size(); ++t) {
      TensorOptimizer& optimizer = state.optimizers[t];
      const std::string& name = model.layers[l].tensors[t].name;
      if (saved_spec.kind() != layers_.spec().kind() ||
          StateFloatsPerElement(saved_spec.kind(), saved_spec.HyperFor(name)) !=
              optimizer.StateBuffers().size()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint ", source.path(), " was trained with --optimizer ", saved->optimizer,
            ", whose state for tensor ", name, " this shard's --optimizer ",
            layers_.spec().ToString(),
            " does not keep: resume with the checkpoint's optimizer (the learning rate and "
            "schedule may change), or start from a fresh --checkpoint-dir"));
      }
      std::vector<std::vector<float>> buffers;
      for (const auto& [buffer, values] : optimizer.StateBuffers()) {
        RETURN_IF_ERROR(source.ReadState(OptimizerStateName(buffer, name), buffers.emplace_back()));
      }
      if (absl::Status restored = optimizer.Restore(saved->optimizer_steps[l], buffers);
          !restored.ok()) {
        return absl::DataLossError(absl::StrCat(
            "checkpoint ", source.path(), ": the optimizer state of tensor ", name, " is damaged (",
            restored.message(), "); start from a fresh --checkpoint-dir or restore the file"));
      }
    }
    layers_.links().gate->Advance(l, saved->layer_versions[l]);
    // Right after the layer's state, in file order: read out of order, the
    // checksum would need a second pass over the whole file.
    RETURN_IF_ERROR(RestoreStagedLocked(source, *saved, l, state));
  }
  return absl::OkStatus();
}

absl::Status TrainerCheckpoint::RestoreStagedLocked(const CheckpointState& source,
                                                    const CheckpointTraining& saved, uint32_t layer,
                                                    TrainerLayers::Layer& state) {
  for (const auto& staged : saved.staged) {
    if (staged.first != layer) continue;
    const std::string& part =
        staged.second;  // not a structured binding: clang 14 cannot capture one
    const auto refuse = [&](absl::string_view why) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", source.path(), " holds a push staged for layer ", layer, " (", part,
          ") that this shard cannot take: ", why,
          "; resume with the checkpoint's --data-parallel-workers and --optimizer, or from a "
          "fresh --checkpoint-dir"));
    };
    if (saved.workers != 0 && saved.workers != layers_.workers()) {
      return refuse(absl::StrCat("it was trained with ", saved.workers,
                                 " data-parallel workers, this shard has ", layers_.workers()));
    }
    const bool mean = part == kStagedMean;
    if (mean && !layers_.spec().clip())
      return refuse("a mean waiting for the clip scale, and no clip=");
    uint64_t worker = 0;
    if (!mean && (!absl::SimpleAtoi(part, &worker) || worker >= layers_.workers())) {
      return refuse("no such worker");
    }
    std::vector<float> values;
    RETURN_IF_ERROR(source.ReadState(StagedPushName(layer, part), values));
    if (values.size() != state.owned_elements || state.reduced || state.pushed[worker]) {
      return absl::DataLossError(absl::StrCat("checkpoint ", source.path(), ": staged push ", layer,
                                              "/", part, " does not fit layer ", layer,
                                              "; start from a fresh --checkpoint-dir"));
    }
    // Charged as when it was written: the step's reservation, or, for a
    // reduced mean, the one push's share the reduction kept.
    RETURN_IF_ERROR(staging_.ChargeRestoredLocked(
        layer, state, mean ? staging_.StagingBytes(layer) : staging_.StepBytes(layer),
        absl::StrCat("checkpoint ", source.path())));
    state.pushed[worker] = std::move(values);
    if (mean) {
      state.reduced = true;
      state.sum_of_squares = TrainerSteps::SumOfSquares(*state.pushed[0]);
    }
  }
  return absl::OkStatus();
}

}  // namespace layercast::server
