#pragma once

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "core/model.h"
#include "core/optimizer_spec.h"
#include "core/parameter_source.h"
#include "core/policy.h"
#include "server/shard/shard_config.h"

namespace layercast::server {

// The parameters a shard serves, as its settings name them: a synthetic
// model, a .safetensors file, an index, or a Hugging Face folder (its index,
// else its model.safetensors; the model named after the folder). Logs what
// it widens (BF16, F16) and warns when no tensor name matches the layer
// rules. NOT_FOUND for a folder with neither file; the source's own errors
// otherwise.
absl::StatusOr<std::unique_ptr<ParameterSource>> OpenSource(const ShardSettings& settings);

// Warns, naming each, about --policy and --optimizer overrides whose glob
// matches no tensor of `model`: most often a typo.
void WarnUnmatchedRules(const ModelSpec& model, const Policy& policy,
                        const std::optional<OptimizerSpec>& optimizer);

}  // namespace layercast::server
