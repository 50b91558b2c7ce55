#include "server/shard/shard_server.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/content_fingerprint.h"
#include "core/layout.h"
#include "platform/byte_size.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_reshard.h"
#include "server/checkpoints/peer_state.h"
#include "server/shard/shard_checkpoint.h"
#include "server/training/journal_reshard.h"
#include "server/training/torch_optimizer_state.h"

// ShardServer's durable state: the checkpoint it starts from, the push
// journal it replays over it, and the checkpoint it writes on exit.

namespace layercast::server {

absl::Status ShardServer::UseCheckpoint() {
  const auto& config = settings_.config;
  if (config.checkpoint_dir().empty()) return UseOptimizerState();
  ASSIGN_OR_RETURN(checkpoints_,
                   CheckpointManager::Create(config.checkpoint_dir(), config.shard_index(),
                                             config.num_shards()));
  if (const int removed = checkpoints_->RemoveStaleTemporaries(); removed > 0) {
    Log()->info("removed {} temporary file(s) of interrupted checkpoint writes from {}", removed,
                checkpoints_->dir());
  }
  ASSIGN_OR_RETURN(std::optional<std::string> existing, checkpoints_->FindExisting());
  std::optional<uint32_t> reshard_from;
  if (!existing) {
    ASSIGN_OR_RETURN(reshard_from, checkpoints_->FindReshardSource());
  }
  if (!existing && !reshard_from) {
    RETURN_IF_ERROR(UseOptimizerState());
    return OpenJournal();
  }
  if (!config.hand_over_from().empty()) {
    Log()->info("--hand-over-from {} not read: --checkpoint-dir holds a checkpoint, which is newer",
                config.hand_over_from());
  }
  if (!config.optimizer_state().empty()) {
    // A restarted shard goes on from its own checkpoint, which holds what
    // it trained since it first started from the state.
    Log()->info(
        "--optimizer-state {} not read: --checkpoint-dir holds a checkpoint, which is newer",
        config.optimizer_state());
  }
  // The values the shard was started with: a checkpoint descending from
  // another model is not silently served in their place.
  ASSIGN_OR_RETURN(const ContentFingerprint model_fingerprint, source_->Fingerprint());
  std::unique_ptr<CheckpointState> checkpoint;
  std::optional<ContentFingerprint> recorded;
  if (existing) {
    ASSIGN_OR_RETURN(
        auto own, CheckpointSource::Open(*existing, source_->model(), config.shard_index(),
                                         config.num_shards(), settings_.policy, model_fingerprint));
    recorded = own->recorded_fingerprint();
    checkpoint = std::move(own);
  } else {
    ASSIGN_OR_RETURN(auto resharded,
                     ReshardedCheckpoint::Open(checkpoints_->dir(), *reshard_from, source_->model(),
                                               config.shard_index(), config.num_shards(),
                                               settings_.policy, model_fingerprint));
    recorded = resharded->recorded_fingerprint();
    resharded_ = resharded.get();
    checkpoint = std::move(resharded);
  }
  if (recorded && *recorded != model_fingerprint) {
    const std::string what = absl::StrCat(
        "checkpoint ", checkpoint->path(), " descends from a model with content fingerprint ",
        FingerprintHex(*recorded, 8), "..., but ",
        config.synthetic().empty() ? "--model" : "--synthetic", " now holds other values (",
        FingerprintHex(model_fingerprint, 8), "...)");
    if (!config.checkpoint_over_changed_model()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what,
                       ": the model was replaced. Remove the checkpoint (or point --checkpoint-dir "
                       "elsewhere) to serve the new model, or pass --checkpoint-over-changed-model "
                       "true to keep serving the checkpoint"));
    }
    Log()->warn("{}; serving the checkpoint as told", what);
  }
  if (resharded_ != nullptr) {
    Log()->info(
        "loading the checkpoints of {} shards {} (version {}) resharded: this shard's ranges, "
        "from {} of their files, instead of {}",
        *reshard_from, checkpoint->path(), checkpoint->version(), resharded_->overlapping().size(),
        config.synthetic().empty() ? "--model's values" : "--synthetic's values");
  } else {
    Log()->info("loading checkpoint {} (version {}) instead of {}", checkpoint->path(),
                checkpoint->version(),
                config.synthetic().empty() ? "--model's values" : "--synthetic's values");
  }
  checkpoint_source_ = checkpoint.get();
  source_ = std::move(checkpoint);
  return OpenJournal();
}

absl::Status ShardServer::UseOptimizerState() {
  const auto& config = settings_.config;
  if (!config.hand_over_from().empty()) return UseHandOver();
  if (config.optimizer_state().empty() || !settings_.optimizer) return absl::OkStatus();
  ASSIGN_OR_RETURN(
      auto state,
      TorchOptimizerState::Open(config.optimizer_state(), std::move(source_), *settings_.optimizer,
                                config.shard_index(), config.num_shards()));
  Log()->info("starting from optimizer state {} (layers at step {} and on) with {}'s values",
              state->path(), state->version(),
              config.synthetic().empty() ? "--model" : "--synthetic");
  checkpoint_source_ = state.get();
  imported_state_ = true;
  source_ = std::move(state);
  return absl::OkStatus();
}

absl::Status ShardServer::UseHandOver() {
  const auto& config = settings_.config;
  ASSIGN_OR_RETURN(PeerCalls calls, PeerCallsFromConfig(config, "--hand-over-from"));
  std::vector<std::string> addresses;
  for (absl::string_view part : absl::StrSplit(config.hand_over_from(), ',', absl::SkipEmpty())) {
    addresses.emplace_back(absl::StripAsciiWhitespace(part));
  }
  ASSIGN_OR_RETURN(auto state,
                   PeerState::Open(std::move(addresses), std::move(calls), std::move(source_),
                                   config.shard_index(), config.num_shards()));
  Log()->info("filling this shard from the {} shards of a running set ({}) frozen at version {}",
              state->from_count(), state->path(), state->version());
  checkpoint_source_ = state.get();
  imported_state_ = true;
  source_ = std::move(state);
  return absl::OkStatus();
}

absl::StatusOr<layercast::v1::JournalIdentity> ShardServer::JournalIdentity() const {
  const auto& config = settings_.config;
  layercast::v1::JournalIdentity identity;
  identity.set_model_id(source_->model().model_id);
  ASSIGN_OR_RETURN(const auto layout_digest, LayoutDigest(source_->model(), settings_.policy));
  identity.set_layout_digest(layout_digest.data(), layout_digest.size());
  ASSIGN_OR_RETURN(const ContentFingerprint fingerprint, source_->Fingerprint());
  identity.set_content_fingerprint(fingerprint.data(), fingerprint.size());
  identity.set_shard_index(config.shard_index());
  identity.set_num_shards(config.num_shards());
  identity.set_checkpoint_version(checkpoint_source_ != nullptr ? checkpoint_source_->version()
                                                                : 0);
  return identity;
}

// A journal written for another model or shard refuses the start (exit 2,
// from Create) as a foreign checkpoint does.
absl::Status ShardServer::OpenJournal() {
  const auto& config = settings_.config;
  if (!config.push_journal() || !settings_.optimizer) return absl::OkStatus();
  ASSIGN_OR_RETURN(layercast::v1::JournalIdentity identity, JournalIdentity());
  PushJournal::Durability durability;
  durability.sync = settings_.journal_sync;
  durability.interval = std::chrono::milliseconds(config.journal_sync_interval_ms());
  durability.clock = settings_.clock;
  ASSIGN_OR_RETURN(journal_, PushJournal::Open(config.checkpoint_dir(), std::move(identity),
                                               DefaultFileSystem(), durability));
  return journal_->CheckIdentity();
}

absl::StatusOr<std::unique_ptr<PushJournal>> ShardServer::ReplayJournal(LayerTrainer& trainer) {
  const auto& config = settings_.config;
  std::unique_ptr<PushJournal> journal = std::move(journal_);
  if (journal == nullptr) {
    return absl::FailedPreconditionError("the push journal was not opened at start");
  }
  const auto start = std::chrono::steady_clock::now();
  if (resharded_ != nullptr) {
    // The journals of the set the checkpoints came from first: they go on
    // from those checkpoints, and this shard's own (pushes taken since it
    // first started resharded) from where they end.
    ASSIGN_OR_RETURN(const layercast::v1::JournalIdentity identity, JournalIdentity());
    absl::StatusOr<ReshardedRecords> records =
        ReadReshardedJournals(config.checkpoint_dir(), identity, source_->model(),
                              resharded_->from_count(), resharded_->overlapping());
    absl::StatusOr<LayerTrainer::Replayed> taken =
        records.ok() ? trainer.checkpoint().Replay(std::move(records->records))
                     : absl::StatusOr<LayerTrainer::Replayed>(records.status());
    if (!taken.ok()) {
      return absl::Status(
          taken.status().code(),
          absl::StrCat("replaying the push journals of the ", resharded_->from_count(),
                       " shards in --checkpoint-dir ", config.checkpoint_dir(),
                       " resharded: ", taken.status().message()));
    }
    metrics_.RecordJournalReplayed(taken->taken);
    Log()->info(
        "push journals of {} shards, resharded: {} record(s) read, {} push(es) and clip scale(s) "
        "taken again, {} already in the checkpoints, {} layer step(s) applied; {} push(es) that "
        "only part of that set took left out for their workers to push again",
        resharded_->from_count(), records->read, taken->taken, taken->skipped, taken->steps,
        records->incomplete);
  }
  absl::StatusOr<LayerTrainer::Replayed> replayed = trainer.checkpoint().Replay(
      *journal, config.accept_journal_damage() ? PushJournal::OnDamage::kAccept
                                               : PushJournal::OnDamage::kRefuse);
  if (!replayed.ok()) {
    return absl::Status(replayed.status().code(),
                        absl::StrCat("replaying the push journal in --checkpoint-dir ",
                                     config.checkpoint_dir(), ": ", replayed.status().message()));
  }
  metrics_.RecordJournalReplayed(replayed->taken);
  if (const auto& damage = replayed->damage; damage) {
    metrics_.RecordJournalDamageAccepted();
    Log()->error(
        "push journal {} is damaged at byte {}; replayed up to its last good step ({}) as "
        "--accept-journal-damage says: ACKNOWLEDGED PUSHES AFTER IT ARE LOST ({} byte(s) and {} "
        "later generation(s), kept as {}.damaged and *.after-damage); the journal now ends there",
        damage->path, damage->offset,
        damage->last_good_step ? absl::StrCat("step ", *damage->last_good_step)
                               : std::string("none"),
        damage->bytes_lost, damage->later_generations, damage->path);
  }
  if (replayed->taken + replayed->skipped > 0) {
    Log()->info(
        "push journal: {} push(es) and clip scale(s) taken again, {} already in the checkpoint, "
        "{} layer step(s) applied, in {:.2f} s",
        replayed->taken, replayed->skipped, replayed->steps,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  trainer.checkpoint().JournalTo(*journal);
  return journal;
}

absl::Status ShardServer::CheckpointOnExit() {
  const auto& config = settings_.config;
  if (checkpoints_ == nullptr || !config.checkpoint_on_sigterm()) return absl::OkStatus();
  if (loaded_ == nullptr) {
    Log()->warn("parameters were not loaded; no checkpoint written");
    return absl::OkStatus();
  }
  const uint64_t version = service_->version_gate().version();
  // A training shard's layers may have moved past the model's version, and
  // its optimizer state with them: it always writes.
  if (loaded_->trainer == nullptr && checkpoints_->HoldsVersion(version)) {
    Log()->info("checkpoint {} already holds version {}", checkpoints_->path(), version);
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(
      CheckpointInfo info,
      WriteShardCheckpoint(*checkpoints_, *loaded_->store, loaded_->trainer.get(),
                           loaded_->publications.get(), service_->version_gate(), false));
  Log()->info("checkpoint version {} written to {} ({}) in {:.2f} s", info.version, info.path,
              FormatBytes(info.bytes), info.seconds);
  return absl::OkStatus();
}

}  // namespace layercast::server
