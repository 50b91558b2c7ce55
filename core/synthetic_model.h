#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "core/parameter_source.h"

namespace layercast {

// A Llama-shaped model with deterministic values, for demos, tests and
// benchmarks. Spec grammar:
//
//   llama:layers=8,hidden=2048,ffn=5632,vocab=32000,seed=1
//
// Every key is optional: absent keys take layers=2, hidden=256, ffn=688,
// vocab=1024, seed=0, and kv=hidden (the rows of k_proj and v_proj: kv
// heads x head dim under grouped-query attention, e.g. kv=1024 for
// Llama-2-70B; the model id names it only when given). Layers: the embedding
// (`model.embed_tokens.weight` [vocab, hidden]); `layers` decoder layers
// (`model.layers.<i>.{input_layernorm, self_attn.{q,k,v,o}_proj,
// post_attention_layernorm, mlp.{gate,up,down}_proj}.weight`); and "final"
// (`model.norm.weight`, `lm_head.weight` [vocab, hidden]).
//
// Each element is a pure function of (seed, tensor name, flat index), so a
// shard makes just its own range, and anyone can recompute any element to
// check it. Thread-safe.
class SyntheticModel : public ParameterSource {
 public:
  // INVALID_ARGUMENT naming the bad key or value (each of layers, hidden,
  // ffn and vocab is 1..2^20), or the model's size when its fp32 master would
  // not fit in a 64-bit byte count.
  static absl::StatusOr<std::unique_ptr<SyntheticModel>> Create(absl::string_view spec);

  const ModelSpec& model() const override { return model_; }
  absl::Status Read(uint32_t layer, uint32_t tensor, ElementRange range,
                    std::span<float> dst) const override;

  // The value of element `index` of the tensor named `tensor_name`.
  static float Value(uint64_t seed, absl::string_view tensor_name, uint64_t index);

 private:
  SyntheticModel() = default;
  ModelSpec model_;
  uint64_t seed_ = 0;
};

}  // namespace layercast
