#pragma once

#include <atomic>
#include <chrono>
#include <memory>

#include <grpcpp/grpcpp.h>
#include <boost/asio/thread_pool.hpp>

#include "absl/status/statusor.h"
#include "core/parameter_source.h"
#include "server/access/tls_credentials.h"
#include "server/casting/cast_error_ledger.h"
#include "server/checkpoints/checkpoint_manager.h"
#include "server/checkpoints/checkpoint_reshard.h"
#include "server/checkpoints/checkpoint_source.h"
#include "server/publishing/publication.h"
#include "server/serving/change_log.h"
#include "server/serving/deadline_timers.h"
#include "server/serving/metrics_endpoint.h"
#include "server/serving/parameter_store.h"
#include "server/serving/server_metrics.h"
#include "server/serving/shared_chunks.h"
#include "server/shard/loaded_shard.h"
#include "server/shard/memory_plan.h"
#include "server/shard/process_metrics.h"
#include "server/shard/shard_admin_service.h"
#include "server/shard/shard_config.h"
#include "server/shard/shard_service.h"
#include "server/training/layer_trainer.h"
#include "server/training/periodic_checkpoints.h"
#include "server/training/push_journal.h"
#include "server/versions/pinned_versions.h"

namespace prometheus {
class Exposer;
}

namespace layercast::server {

// One shard server process's parts, in the order they come up: Create()
// checks everything that can fail without binding a port (config, model
// header, memory budget, TLS files, admin token, the checkpoint's header);
// Start() binds and serves health and reflection with readiness
// NOT_SERVING; Load() reads the shard's parameters (from its checkpoint when
// --checkpoint-dir holds one) and turns readiness SERVING; Shutdown()
// drains; CheckpointOnExit() then saves the parameters.
//
// Thread-safety: Shutdown() may be called from any thread once, concurrently
// with Load(); the other methods from one thread.
class ShardServer {
 public:
  // The health service name Kubernetes probes for readiness.
  static constexpr char kReadinessService[] = "layercast.v1.ShardService";

  static absl::StatusOr<std::unique_ptr<ShardServer>> Create(ShardSettings settings);
  ~ShardServer();

  // Binds `listen` (and `metrics_listen`, `health_listen`, if set), starts
  // serving, logs "listening on HOST:PORT" (and "metrics on HOST:PORT",
  // "health on HOST:PORT") and writes the port file. UNAVAILABLE if an
  // address cannot be bound.
  absl::Status Start();

  // Loads this shard's parameters; CANCELLED if `*cancel` turns true first.
  // From a checkpoint, DATA_LOSS naming the file when its data does not
  // match its checksum (nothing is served; layercast-shard exits 2).
  absl::Status Load(const std::atomic<bool>* cancel);

  // Readiness NOT_SERVING, new streams refused with UNAVAILABLE, streams in
  // flight given until `drain` to finish (then cancelled); returns when the
  // server has stopped. Blocks the calling thread for up to `drain`.
  void Shutdown(std::chrono::milliseconds drain);

  // After Shutdown(): writes the checkpoint if --checkpoint-on-sigterm is on
  // (the default with --checkpoint-dir), parameters were loaded, and the
  // file does not already hold this version. Logs what it did; the write's
  // error otherwise.
  absl::Status CheckpointOnExit();

  // The limit on FetchLayer streams in flight (--max-streams, resolved).
  uint32_t max_streams() const { return settings_.config.max_streams(); }

  int port() const { return port_; }
  // The metrics endpoint's port; 0 without one.
  int metrics_port() const { return metrics_port_; }
  // The plaintext health port's port; 0 without --health-listen.
  int health_port() const { return health_port_; }
  ServerMetrics& metrics() { return metrics_; }
  const ShardSettings& settings() const { return settings_; }
  ShardService& service() { return *service_; }
  ShardAdminService& admin() { return *admin_; }
  // Null without --checkpoint-dir.
  CheckpointManager* checkpoints() { return checkpoints_.get(); }
  // The memory budget; nullptr until Load() is done.
  const MemoryBudget* budget() const { return loaded_ ? loaded_->budget.get() : nullptr; }
  // Null before Load() and with --shared-chunk-bytes 0.
  const SharedChunks* shared_chunks() const { return loaded_ ? loaded_->shared.get() : nullptr; }
  // The chunk buffers; null before Load().
  const ChunkPool* chunk_pool() const { return loaded_ ? loaded_->pool.get() : nullptr; }
  // What each chunk's cast lost, and its CRC (tests put a fault in it).
  CastErrorLedger& cast_errors() { return *cast_errors_; }
  // The memory plan the server sized its budget and ledger by.
  const MemoryPlan& plan() const { return plan_; }

 private:
  explicit ShardServer(ShardSettings settings);

  absl::Status StartMetrics();
  absl::Status StartHealth();
  // Sets the readiness service's status on every port that serves health.
  void SetReadiness(bool serving);
  // Makes --checkpoint-dir's checkpoint, if it holds one, the source.
  absl::Status UseCheckpoint();
  // Without a checkpoint: makes --optimizer-state, if given, the source of
  // the optimizer state, the values still --model's.
  absl::Status UseOptimizerState();
  // The state of a running set frozen for a hand-over (--hand-over-from).
  absl::Status UseHandOver();
  // What this shard's push journal generations record of it.
  absl::StatusOr<layercast::v1::JournalIdentity> JournalIdentity() const;
  // At start, before anything loads: opens the push journal (journal_) and
  // refuses one written for another model or shard.
  absl::Status OpenJournal();
  // Takes again what journal_ holds over the checkpoint `trainer`
  // restored, and journals `trainer`'s pushes to it; returns it.
  absl::StatusOr<std::unique_ptr<PushJournal>> ReplayJournal(LayerTrainer& trainer);
  // Writes the bound port to --port-file.
  absl::Status WritePortFile();

  ShardSettings settings_;
  // Runs every grant (a version reached, budget granted, a shared chunk
  // cast) so that no grant runs on the granter's thread. First: it outlives
  // everything that posts to it.
  boost::asio::thread_pool grants_{std::max(2u, std::thread::hardware_concurrency())};
  // The shard's timer thread: the version gate's, the budget's, the pinned
  // versions' and the stall sweep's deadlines run on it. After grants_,
  // which its callbacks post to; before everything that schedules on it.
  DeadlineTimers timers_;
  // The shard's background thread, on timers_' clock: the work that blocks
  // for long (checkpoint writes, periodic or asked for; digests; a
  // publish's timeout, which waits for a commit) runs here one piece at a
  // time, never on timers_, whose callbacks must not wait. Each part
  // schedules through a DeadlineTimers of its own on it, which stops its
  // work when the part goes: the shard's one stop rule.
  //
  // One after another: a publish timeout can fire as late as one checkpoint
  // write after its deadline, and a GetLayerDigest can wait behind a write
  // (ShardAdmin.Checkpoint does not: it is refused with ABORTED while
  // another write is under way, see ShardAdminService).
  //
  // On timers_' clock because publish timeouts are, and tests move that
  // clock through them. So a test's ManualClock::Advance also waits for the
  // background work under way (a write, a digest) to finish before it
  // returns (DeadlineTimers::Jumped runs on this thread): a test deadlocks
  // if it advances the clock while that work waits on something the
  // advancing thread holds (a lock, a notification it would give after
  // Advance returns, a reply it has yet to read).
  DeadlineTimers background_;
  ServerMetrics metrics_;
  // The start-up check's arithmetic, from the model's shapes (a checkpoint
  // must have the same): its ReservedBytes are reserved in budget_.
  MemoryPlan plan_;
  // What each chunk's cast lost, for GetCastError and the policy's bound;
  // sized by the memory plan.
  std::unique_ptr<CastErrorLedger> cast_errors_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  int metrics_port_ = 0;
  ServerSecurity security_;
  std::unique_ptr<CheckpointManager> checkpoints_;
  std::unique_ptr<ParameterSource> source_;
  // source_ when it is a checkpoint, for its checksum and version.
  CheckpointState* checkpoint_source_ = nullptr;
  // source_ when it is the checkpoints of another shard count, whose
  // journals are replayed too.
  ReshardedCheckpoint* resharded_ = nullptr;
  // checkpoint_source_ is --optimizer-state's, not a checkpoint on disk.
  bool imported_state_ = false;
  // --push-journal's, opened and checked by OpenJournal, until Load's replay.
  std::unique_ptr<PushJournal> journal_;
  std::unique_ptr<ShardService> service_;
  std::unique_ptr<ShardAdminService> admin_;
  std::unique_ptr<grpc::Server> server_;
  // Plaintext, health only (--health-listen); null without one.
  std::unique_ptr<grpc::Server> health_server_;
  int health_port_ = 0;
  // The set, for settling publishes (--peers), until Load hands it to the
  // shard's publications.
  std::unique_ptr<PublishPeers> peers_;
  uint32_t publish_idle_ms_ = 0;
  std::shared_ptr<ProcessMetrics> process_metrics_ = std::make_shared<ProcessMetrics>();
  // Null until Load() is done. After the services: destroyed before them,
  // since its trainer, publications and periodic checkpoints use their
  // VersionGate. The destructor detaches it from ShardService, whose sweep
  // still runs; ShardAdminService takes no call once the server has
  // stopped.
  std::unique_ptr<LoadedShard> loaded_;
  int port_ = 0;
};

}  // namespace layercast::server
