#pragma once

#include <atomic>
#include <chrono>
#include <memory>

#include <grpcpp/grpcpp.h>
#include <boost/asio/thread_pool.hpp>

#include "absl/status/statusor.h"
#include "core/parameter_source.h"
#include "server/cast_error_ledger.h"
#include "server/change_log.h"
#include "server/checkpoint_manager.h"
#include "server/checkpoint_source.h"
#include "server/layer_trainer.h"
#include "server/memory_plan.h"
#include "server/metrics_endpoint.h"
#include "server/parameter_store.h"
#include "server/periodic_checkpoints.h"
#include "server/pinned_versions.h"
#include "server/process_metrics.h"
#include "server/publication.h"
#include "server/push_journal.h"
#include "server/server_metrics.h"
#include "server/shard_admin_service.h"
#include "server/shard_config.h"
#include "server/shard_service.h"
#include "server/shared_chunks.h"
#include "server/tls_credentials.h"

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
  const MemoryBudget* budget() const { return budget_.get(); }
  // Null before Load() and with --shared-chunk-bytes 0.
  const SharedChunks* shared_chunks() const { return shared_.get(); }
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
  // Opens --checkpoint-dir's push journal, takes again what it holds over
  // the checkpoint `trainer` restored, and journals `trainer`'s pushes.
  absl::Status ReplayJournal(LayerTrainer& trainer);
  // Writes the bound port to --port-file.
  absl::Status WritePortFile();

  ShardSettings settings_;
  // Runs every grant (a version reached, budget granted, a shared chunk
  // cast) so that no grant runs on the granter's thread. First: it outlives
  // everything that posts to it.
  boost::asio::thread_pool grants_{std::max(2u, std::thread::hardware_concurrency())};
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
  CheckpointSource* checkpoint_source_ = nullptr;
  std::unique_ptr<ShardService> service_;
  std::unique_ptr<ShardAdminService> admin_;
  std::unique_ptr<grpc::Server> server_;
  // Plaintext, health only (--health-listen); null without one.
  std::unique_ptr<grpc::Server> health_server_;
  int health_port_ = 0;
  std::unique_ptr<ParameterStore> store_;
  std::unique_ptr<MemoryBudget> budget_;
  // Which values each of the last --delta-versions changed; null with 0.
  std::unique_ptr<ChangeLog> changes_;
  // Versions kept for pinned readers; null with --pin-retention-ms 0 or
  // --delta-versions 0. Before publications_ and trainer_, which use it, and
  // after budget_: its kept bytes go back before the budget goes. Shared
  // with the budget's reclaimer, which holds it weakly.
  std::shared_ptr<PinnedVersions> pinned_;
  // The set, for settling publishes (--peers), until publications_ takes it.
  std::unique_ptr<PublishPeers> peers_;
  uint32_t publish_idle_ms_ = 0;
  // A read-only shard's publishes; null on a training shard.
  std::unique_ptr<Publications> publications_;
  // After budget_: destroyed first, giving its bytes back. Shared with the
  // budget's reclaimer, which holds it weakly.
  std::shared_ptr<SharedChunks> shared_;
  std::shared_ptr<ProcessMetrics> process_metrics_ = std::make_shared<ProcessMetrics>();
  // After budget_ and store_: gives staged pushes' bytes back to the one and
  // steps the other. Null without --optimizer.
  // Every push trainer_ takes, until a checkpoint holds it
  // (--push-journal). Before trainer_, which appends to it.
  std::unique_ptr<PushJournal> journal_;
  std::unique_ptr<LayerTrainer> trainer_;
  // --checkpoint-every. After trainer_ and store_, which it writes: stopped
  // before they go.
  std::unique_ptr<PeriodicCheckpoints> periodic_checkpoints_;
  int port_ = 0;
};

}  // namespace layercast::server
