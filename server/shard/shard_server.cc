#include "server/shard/shard_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "platform/byte_size.h"
#include "platform/file_system.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "server/access/auth_token.h"
#include "server/access/worker_tokens.h"
#include "server/shard/memory_plan.h"
#include "server/shard/model_source.h"
#include "server/shard/shard_checkpoint.h"

namespace layercast::server {
namespace {

// Workers in step still drift apart within a walk. Measured with 4 and 8
// workers in lockstep (gather_bench --sharing): room for twice this shard's
// part of its largest layer let every chunk be cast once (75% and 87.5% of
// chunks shared); room for one layer, 64% and 56%; 32 chunks, less.
constexpr uint64_t kSharedLayers = 2;
constexpr uint64_t kMinSharedChunks = 32;
// Chunk buffers a shard keeps for reuse (ChunkPool): enough for a few
// streams' chunks in flight and the kept chunks of one worker's walk
// coming back, at chunk_bytes each.
constexpr size_t kPooledChunks = 32;

// This shard's part of its largest layer, in the compute dtypes.
uint64_t LargestLayerShareBytes(const ParameterStore& store) {
  uint64_t largest = 0;
  for (uint32_t layer = 0; layer < store.model().layers.size(); ++layer) {
    uint64_t bytes = 0;
    const auto& tensors = store.layout(layer).tensors();
    for (uint32_t t = 0; t < tensors.size(); ++t) {
      bytes += store.owned(layer, t).size() * DTypeSize(tensors[t].compute_dtype);
    }
    largest = std::max(largest, bytes);
  }
  return largest;
}

// Picks the cast kernels before anything casts: --cast-isa, or measured.
absl::Status PickCastKernels(const std::optional<CastIsa>& chosen) {
  if (chosen) {
    if (absl::Status status = ChooseCastIsa(*chosen); !status.ok()) {
      // Another shard server in this process (tests) chose the same already.
      const CastIsaSelection& selected = SelectedCastIsa();
      const bool same =
          selected.chosen && std::all_of(selected.choices.begin(), selected.choices.end(),
                                         [&](const auto& c) { return c.isa == *chosen; });
      if (!same) {
        return absl::FailedPreconditionError(absl::StrCat("--cast-isa: ", status.message()));
      }
    }
  }
  SelectedCastIsa();  // measures, unless chosen
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Create(ShardSettings settings) {
  // First: the metrics' build info names the kernels.
  RETURN_IF_ERROR(PickCastKernels(settings.cast_isa));
  auto server = std::unique_ptr<ShardServer>(new ShardServer(std::move(settings)));
  ASSIGN_OR_RETURN(server->source_, OpenSource(server->settings_));
  const auto& config = server->settings_.config;
  const ModelSpec& model = server->source_->model();
  if (model.layers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("model ", model.model_id, " has no layers"));
  }
  std::optional<TrainingPlan> training;
  if (server->settings_.optimizer) {
    training = TrainingPlan{*server->settings_.optimizer, config.data_parallel_workers()};
  }
  ASSIGN_OR_RETURN(
      server->plan_,
      PlanShardMemory(model, server->settings_.policy, config.shard_index(), config.num_shards(),
                      config.chunk_bytes(), config.delta_versions(), training));
  const MemoryPlan& plan = server->plan_;
  const uint64_t master = plan.master_bytes;
  server->cast_errors_ = std::make_unique<CastErrorLedger>(plan.grid_chunks, plan.layers);
  if (const std::optional<uint64_t> budget = server->settings_.memory_budget_bytes) {
    RETURN_IF_ERROR(CheckPlanFits(plan, training, *budget));
  }
  ASSIGN_OR_RETURN(server->security_, ServerSecurityFor(config));
  ShardAdminService::Options admin;
  if (!config.admin_token_file().empty()) {
    ASSIGN_OR_RETURN(admin.token, AdminToken::FromFile(config.admin_token_file()));
    if (!server->security_.tls) {
      Log()->warn(
          "--admin-token-file without TLS: the token crosses the network in clear text; use "
          "--tls-cert-file and --tls-key-file beyond loopback");
    }
  }
  std::optional<WorkerTokens> worker_tokens;
  if (!config.worker_token_dir().empty()) {
    ASSIGN_OR_RETURN(worker_tokens, WorkerTokens::FromDir(config.worker_token_dir(),
                                                          config.data_parallel_workers()));
    if (!server->security_.tls) {
      Log()->warn(
          "--worker-token-dir without TLS: the workers' tokens cross the network in clear text; "
          "use --tls-cert-file and --tls-key-file beyond loopback");
    }
  }
  // A training shard takes no publishes: nothing to settle.
  if (config.optimizer().empty()) {
    ASSIGN_OR_RETURN(server->peers_, PublishPeers::FromConfig(config, server->timers_.clock()));
  }
  server->publish_idle_ms_ = config.publish_idle_ms();
  RETURN_IF_ERROR(server->UseCheckpoint());
  admin.checkpoints = server->checkpoints_.get();
  server->service_ = std::make_unique<ShardService>(
      ShardService::Options{
          .chunk_bytes = config.chunk_bytes(),
          .max_streams = config.max_streams(),
          .max_parked_streams = config.max_parked_streams(),
          .max_push_streams = config.max_push_streams(),
          .max_push_streams_per_connection = config.max_push_streams_per_connection(),
          .max_waits_per_connection = config.max_waits_per_connection(),
          .max_version_lead = config.max_version_lead(),
          .max_version_wait = std::chrono::milliseconds(config.max_version_wait_ms()),
          .write_progress_timeout = std::chrono::milliseconds(config.write_progress_timeout_ms()),
          .worker_tokens = std::move(worker_tokens),
          .cast_errors = server->cast_errors_.get(),
          .cast_error_sample_every = config.cast_error_sample_every()},
      server->metrics_, server->grants_.get_executor(), &server->timers_);
  server->admin_ = std::make_unique<ShardAdminService>(
      std::move(admin), server->service_->version_gate(), server->metrics_, &server->background_);
  server->metrics_.master_bytes().Set(static_cast<double>(master));
  server->metrics_.memory_budget_bytes().Set(
      static_cast<double>(server->settings_.memory_budget_bytes.value_or(0)));
  return server;
}

ShardServer::ShardServer(ShardSettings settings)
    : settings_(std::move(settings)),
      timers_(settings_.clock != nullptr ? *settings_.clock : platform::Clock::Steady()),
      background_(timers_.clock()) {
  // Named, so that /proc/PID/task and `ps -L` tell the shard's own threads
  // from gRPC's and civetweb's.
  timers_.Post([] { pthread_setname_np(pthread_self(), "lc-timers"); });
  background_.Post([] { pthread_setname_np(pthread_self(), "lc-background"); });
}

ShardServer::~ShardServer() {
  if (server_ != nullptr) Shutdown(std::chrono::milliseconds(0));
  // The service's sweep reads the trainer's open steps until it goes.
  if (service_ != nullptr) service_->DetachStore();
}

absl::Status ShardServer::Load(const std::atomic<bool>* cancel) {
  const auto& config = settings_.config;
  const auto started = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(std::unique_ptr<ParameterStore> store,
                   ParameterStore::Load(*source_, config.shard_index(), config.num_shards(),
                                        settings_.policy, cancel));
  if (checkpoint_source_ != nullptr) {
    if (settings_.optimizer && checkpoint_source_->version() > 0 &&
        !checkpoint_source_->training()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint in --checkpoint-dir holds parameter version ",
          checkpoint_source_->version(), " written by a shard without --optimizer, so no ",
          "optimizer state: training on would restart ",
          OptimizerKindName(settings_.optimizer->kind()),
          " from zero state and diverge from an uninterrupted run; start from a fresh "
          "--checkpoint-dir, or serve this checkpoint read-only without --optimizer"));
    }
    service_->version_gate().Advance(checkpoint_source_->version());
    // A training shard's layers may be ahead of the model's version: each
    // is served at its own, with or without --optimizer now.
    if (const auto& training = checkpoint_source_->training(); training) {
      const auto layers = static_cast<uint32_t>(training->layer_versions.size());
      service_->version_gate().SetLayers(layers);
      for (uint32_t l = 0; l < layers; ++l) {
        service_->version_gate().Advance(l, training->layer_versions[l]);
      }
    }
  }
  WarnUnmatchedRules(store->model(), settings_.policy, settings_.optimizer);
  auto shard = std::make_unique<LoadedShard>();
  shard->store = std::move(store);
  const ParameterStore& loaded_store = *shard->store;
  shard->budget = std::make_unique<MemoryBudget>(
      settings_.memory_budget_bytes, plan_.ReservedBytes(), grants_.get_executor(),
      [this](uint64_t in_use, size_t waiting) {
        metrics_.memory_in_use_bytes().Set(static_cast<double>(in_use));
        metrics_.streams_waiting_for_budget().Set(static_cast<double>(waiting));
      },
      &timers_);
  if (const uint32_t delta_versions = config.delta_versions(); delta_versions > 0) {
    shard->changes =
        std::make_unique<ChangeLog>(loaded_store, delta_versions, &metrics_,
                                    std::chrono::milliseconds(config.change_recording_idle_ms()));
  }
  if (shard->changes != nullptr && config.pin_retention_ms() > 0) {
    shard->pinned = std::make_shared<PinnedVersions>(
        loaded_store, std::chrono::milliseconds(config.pin_retention_ms()), config.pin_versions(),
        *shard->budget, metrics_, &timers_);
  }
  if (settings_.optimizer) {
    service_->version_gate().SetLayers(static_cast<uint32_t>(loaded_store.model().layers.size()));
    ASSIGN_OR_RETURN(
        shard->trainer,
        LayerTrainer::Create(*shard->store, *settings_.optimizer, config.data_parallel_workers(),
                             {&service_->version_gate(), shard->budget.get(), shard->changes.get(),
                              shard->pinned.get()}));
    LayerTrainer& trainer = *shard->trainer;
    if (checkpoint_source_ != nullptr) {
      if (absl::Status restored = trainer.checkpoint().Restore(*checkpoint_source_);
          !restored.ok()) {
        // A damaged file says so first (DATA_LOSS, exit status 2).
        RETURN_IF_ERROR(checkpoint_source_->VerifyChecksum());
        return restored;
      }
    }
    if (config.push_journal()) {
      ASSIGN_OR_RETURN(shard->journal, ReplayJournal(trainer));
    }
    Log()->info("training: {} with {} data-parallel worker(s), {} of optimizer state, from {}",
                settings_.optimizer->ToString(), config.data_parallel_workers(),
                FormatBytes(plan_.state_bytes),
                checkpoint_source_ != nullptr && checkpoint_source_->training()
                    ? absl::StrCat(!imported_state_                  ? "the checkpoint's"
                                   : config.hand_over_from().empty() ? "--optimizer-state's"
                                                                     : "the old set's",
                                   " state at version ", checkpoint_source_->version())
                    : std::string("zero state"));
  }
  if (checkpoint_source_ != nullptr) {
    // Before the shard is served: parameters (and optimizer state) that fail
    // their checksum are never served, nor written back as a checkpoint on
    // exit.
    RETURN_IF_ERROR(checkpoint_source_->VerifyChecksum());
    if (!imported_state_) checkpoints_->NoteOnDisk(checkpoint_source_->version());
  }
  const uint64_t shared_bytes =
      config.has_shared_chunk_bytes()
          ? config.shared_chunk_bytes()
          : std::max(kMinSharedChunks * config.chunk_bytes(),
                     kSharedLayers * LargestLayerShareBytes(loaded_store));
  shard->pool = std::make_shared<ChunkPool>(config.chunk_bytes(), kPooledChunks, *shard->budget);
  if (config.cast_cache_bytes() > 0 && shard->trainer == nullptr) {
    shard->cast_cache =
        std::make_shared<CastCache>(CastCache::Options{.capacity_bytes = config.cast_cache_bytes(),
                                                       .chunk_bytes = config.chunk_bytes(),
                                                       .shard_index = loaded_store.shard_index(),
                                                       .num_shards = loaded_store.num_shards()},
                                    loaded_store.layouts(), *shard->budget, metrics_);
    uint64_t all = 0;
    for (const AssembledLayout& layout : loaded_store.layouts()) {
      all += CastCache::LayerBytes(layout, loaded_store.shard_index(), loaded_store.num_shards());
    }
    Log()->info(
        "cast cache: up to {} (--cast-cache-bytes) of the {} this shard's layers take in "
        "their compute dtypes, as the budget has room",
        FormatBytes(config.cast_cache_bytes()), FormatBytes(all));
  }
  if (shared_bytes > 0) {
    shard->shared = std::make_shared<SharedChunks>(
        shared_bytes, std::chrono::milliseconds(config.shared_chunk_max_idle_ms()), *shard->budget,
        metrics_, grants_.get_executor(), &timers_);
  }
  // A request that has to wait for budget first gets what is only kept for
  // speed: cast chunks kept for other streams, the cast cache, idle chunk
  // buffers, pooled gradient staging, versions kept for pinned readers.
  shard->budget->SetReclaimer([shared = std::weak_ptr<SharedChunks>(shard->shared),
                               cache = std::weak_ptr<CastCache>(shard->cast_cache),
                               buffers = std::weak_ptr<ChunkPool>(shard->pool),
                               staging = shard->trainer ? shard->trainer->staging().spare_staging()
                                                        : std::weak_ptr<StagingPool>(),
                               pinned = std::weak_ptr<PinnedVersions>(shard->pinned)] {
    if (auto chunks = shared.lock()) chunks->DropAll();
    if (auto cached = cache.lock()) cached->DropAll();
    // After the kept chunks, whose buffers came back to it.
    if (auto idle = buffers.lock()) idle->Drain();
    if (auto pool = staging.lock()) pool->Drain();
    if (auto kept = pinned.lock()) kept->DropAll();
  });
  if (shard->trainer == nullptr) {
    shard->publications = std::make_unique<Publications>(
        Publications::Links{.store = shard->store.get(),
                            .gate = &service_->version_gate(),
                            .budget = shard->budget.get(),
                            .changes = shard->changes.get(),
                            .metrics = &metrics_,
                            .pinned = shard->pinned.get(),
                            .clock = &timers_.clock(),
                            .background = &background_},
        Publications::SetOptions{.peers = std::move(peers_),
                                 .idle = std::chrono::milliseconds(publish_idle_ms_)});
  }
  if (shard->trainer != nullptr && config.checkpoint_every() > 0) {
    shard->periodic_checkpoints = std::make_unique<PeriodicCheckpoints>(
        service_->version_gate(), config.checkpoint_every(),
        [this, store = shard->store.get(), trainer = shard->trainer.get()] {
          return WriteShardCheckpoint(*checkpoints_, *store, trainer, nullptr,
                                      service_->version_gate(), /*try_only=*/false);
        },
        &background_);
  }
  shard->digests =
      std::make_unique<LayerDigests>(LayerDigests::Links{.store = shard->store.get(),
                                                         .gate = &service_->version_gate(),
                                                         .changes = shard->changes.get(),
                                                         .pinned = shard->pinned.get(),
                                                         .metrics = &metrics_,
                                                         .chunk_bytes = config.chunk_bytes(),
                                                         .stopping = service_->draining(),
                                                         .background = &background_});
  loaded_ = std::move(shard);
  service_->AttachStore(*loaded_);
  admin_->AttachStore(*loaded_);
  SetReadiness(true);
  metrics_.ready().Set(1);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  Log()->info("loaded {} of fp32 master for {} ({} layers) in {:.2f} s; ready",
              FormatBytes(loaded_store.master_bytes()), loaded_store.model().model_id,
              loaded_store.model().layers.size(), seconds);
  return absl::OkStatus();
}

void ShardServer::Shutdown(std::chrono::milliseconds drain) {
  if (server_ == nullptr) return;
  // Refuse new streams with UNAVAILABLE (gRPC's own shutdown would answer
  // CANCELLED) and let the ones in flight finish; only then stop gRPC, which
  // cancels whatever the drain deadline left.
  service_->StartDraining();
  admin_->StartDraining();
  // A periodic write in progress finishes; none starts after (the exit
  // checkpoint, if any, is written below).
  if (loaded_ != nullptr) loaded_->periodic_checkpoints.reset();
  metrics_.ready().Set(0);
  SetReadiness(false);
  const int64_t in_flight = service_->streams_in_flight();
  const bool streaming = service_->streams_streaming() > 0;
  const auto drain_start = std::chrono::steady_clock::now();
  const bool drained = service_->WaitForStreams(absl::Now() + absl::FromChrono(drain));
  if (drained && in_flight > 0) {
    Log()->info(
        "drained {} stream(s) in {:.1f} s", in_flight,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - drain_start).count());
    // A stream is done once its last chunk is in the transport, up to a flow
    // control window ahead of its reader. Exiting at once would close the
    // socket with the reader's window updates unread, and the kernel then
    // resets the connection, discarding what the reader had not read yet.
    // Linger while the drain allows, a second at most, for it to read them.
    const auto lingered = std::min<std::chrono::steady_clock::duration>(
        std::chrono::seconds(1), drain - (std::chrono::steady_clock::now() - drain_start));
    if (streaming && lingered > std::chrono::steady_clock::duration::zero()) {
      std::this_thread::sleep_for(lingered);
    }
  }
  if (!drained) {
    Log()->warn(
        "drain timeout of {} ms passed; ending {} stream(s) with UNAVAILABLE at their next "
        "chunk",
        drain.count(), service_->streams_in_flight());
    // Workers resume what is left elsewhere; a reader that does not drain
    // its chunk within a second is cancelled by gRPC's shutdown below.
    service_->StopStreams();
    service_->WaitForStreams(absl::Now() + absl::Seconds(1));
  }
  // Waits for a checkpoint being written for a ShardAdmin call to finish.
  const auto grpc_start = std::chrono::steady_clock::now();
  server_->Shutdown(std::chrono::system_clock::now());
  server_->Wait();
  server_.reset();
  if (const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - grpc_start).count();
      seconds > 1) {
    Log()->info(
        "gRPC's shutdown took {:.1f} s (a checkpoint being written for `layercast "
        "checkpoint`, or calls it cancelled)",
        seconds);
  }
  if (health_server_ != nullptr) {
    health_server_->Shutdown(std::chrono::system_clock::now());
    health_server_->Wait();
    health_server_.reset();
  }
}

}  // namespace layercast::server
