#include "server/shard_checkpoint.h"

namespace layercast::server {

absl::StatusOr<CheckpointInfo> WriteShardCheckpoint(CheckpointManager& checkpoints,
                                                    const ParameterStore& store,
                                                    LayerTrainer* trainer, uint64_t version,
                                                    bool try_only) {
  const auto write = [&](uint64_t at, const CheckpointExtras& extras) {
    return try_only ? checkpoints.TryWrite(store, at, extras)
                    : checkpoints.Write(store, at, extras);
  };
  if (trainer == nullptr) return write(version, {});
  return trainer->WriteWithState(write);
}

}  // namespace layercast::server
