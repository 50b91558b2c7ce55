#pragma once

// The store publish_stage_fuzzer stages into, and make_fuzz_seeds writes
// its seeds for: shard 1 of 2 of a tiny LLaMA, bf16 with fp32 norms.

#include <cstdlib>
#include <memory>

#include "core/policy.h"
#include "core/synthetic_model.h"
#include "server/serving/parameter_store.h"

namespace layercast::fuzz {

inline constexpr char kPublishStageModel[] = "llama:layers=1,hidden=8,ffn=12,vocab=10";
inline constexpr char kPublishStagePolicy[] = "p=f32,c=bf16;*norm*=f32";

// Built once; a commit changes its master, which no property depends on.
inline server::ParameterStore& PublishStageFixture() {
  static server::ParameterStore* store = [] {
    auto model = SyntheticModel::Create(kPublishStageModel);
    auto policy = Policy::Parse(kPublishStagePolicy);
    if (!model.ok() || !policy.ok()) std::abort();
    auto loaded = server::ParameterStore::Load(**model, 1, 2, *policy);
    if (!loaded.ok()) std::abort();
    return loaded->release();
  }();
  return *store;
}

}  // namespace layercast::fuzz
