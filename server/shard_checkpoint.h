#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "server/checkpoint_manager.h"
#include "server/layer_trainer.h"
#include "server/parameter_store.h"

namespace layercast::server {

// Writes the shard's checkpoint through `checkpoints`: its fp32 master at
// `version`, or, for a training shard (`trainer` not null), its master and
// optimizer state with every layer's steps paused for the write, at the
// model's version (see LayerTrainer::WriteWithState). `try_only`: ABORTED at
// once while another write is in progress (CheckpointManager::TryWrite).
absl::StatusOr<CheckpointInfo> WriteShardCheckpoint(CheckpointManager& checkpoints,
                                                    const ParameterStore& store,
                                                    LayerTrainer* trainer, uint64_t version,
                                                    bool try_only);

}  // namespace layercast::server
