#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "server/checkpoints/checkpoint_manager.h"
#include "server/publishing/publication.h"
#include "server/serving/parameter_store.h"
#include "server/serving/version_gate.h"
#include "server/training/layer_trainer.h"

namespace layercast::server {

// Writes the shard's checkpoint through `checkpoints`, holding one version
// of the master for the whole write: a read-only shard's with no publish
// committing meanwhile (`publications`, when not null), at the model's
// version in `gate` then; a training shard's (`trainer` not null) master
// and optimizer state with every layer's steps paused, at the model's
// version (see TrainerCheckpoint::WriteWithState). `try_only`: ABORTED at once
// while another write is in progress (CheckpointManager::TryWrite).
absl::StatusOr<CheckpointInfo> WriteShardCheckpoint(CheckpointManager& checkpoints,
                                                    const ParameterStore& store,
                                                    LayerTrainer* trainer,
                                                    Publications* publications,
                                                    const VersionGate& gate, bool try_only);

}  // namespace layercast::server
