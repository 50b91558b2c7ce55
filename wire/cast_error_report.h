#pragma once

#include "core/cast_error.h"
#include "layercast/v1/shard.pb.h"

namespace layercast::wire {

// A CastError in a GetCastError answer, and back: the shard writes its
// figures, the CLI and tests read them and add the shards' up.
void CastErrorToProto(const CastError& error, layercast::v1::LayerCastError* out);
// A row with fewer or more `above` counts
// than CastError::kBuckets (another build's shard) keeps the ones it has.
CastError CastErrorFromProto(const layercast::v1::LayerCastError& row);

}  // namespace layercast::wire
