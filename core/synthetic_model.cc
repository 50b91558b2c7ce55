#include "core/synthetic_model.h"

#include <charconv>
#include <initializer_list>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "platform/status_macros.h"

namespace layercast {
namespace {

constexpr absl::string_view kPrefix = "llama:";

// FNV-1a: the synthetic values are part of a reproducible spec, so the name
// hash must never change between builds (std::hash gives no such promise).
uint64_t NameHash(absl::string_view name) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (char c : name) {
    hash ^= static_cast<uint8_t>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

TensorSpec Tensor(std::string name, std::vector<int64_t> shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return TensorSpec{std::move(name), std::move(shape), n};
}

bool IsNorm(absl::string_view name) { return absl::StrContains(name, "norm"); }

// 24 random bits -> uniform in [-1, 1): full fp32 mantissas, so casting rounds
// in every direction and hits ties. Norm weights sit near 1, others near 0.
float ElementValue(uint64_t name_seed, bool norm, uint64_t index) {
  const uint64_t bits = SplitMix64(name_seed + index);
  const float unit = static_cast<float>(static_cast<int64_t>(bits >> 40) - (1 << 23)) /
                     static_cast<float>(1 << 23);
  return norm ? 1.0f + 0.1f * unit : 0.05f * unit;
}

// Refuses a spec whose fp32 master does not fit in a 64-bit byte count,
// before its layers (hundreds of thousands, by then) are built. With every value at most
// 2^20, no tensor exceeds 2^40 elements and no layer 7*2^40 + 2^21 (28 TiB of
// fp32, under kMaxAssembledLayerBytes), so only the sum over layers can
// overflow; the products are checked all the same.
absl::Status CheckSize(absl::string_view spec, uint64_t layers, uint64_t hidden, uint64_t ffn,
                       uint64_t vocab) {
  bool wrapped = false;
  // sum += the product of `factors`.
  const auto add = [&wrapped](uint64_t& sum, std::initializer_list<uint64_t> factors) {
    uint64_t product = 1;
    for (uint64_t factor : factors) wrapped |= __builtin_mul_overflow(product, factor, &product);
    wrapped |= __builtin_add_overflow(sum, product, &sum);
  };
  uint64_t decoder = 0, total = 0, bytes = 0;
  add(decoder, {4, hidden, hidden});  // q, k, v, o projections
  add(decoder, {3, hidden, ffn});     // gate, up, down
  add(decoder, {2, hidden});          // the two norms
  add(total, {layers, decoder});
  add(total, {2, vocab, hidden});  // embedding and lm_head
  add(total, {hidden});            // final norm
  add(bytes, {total, sizeof(float)});
  if (!wrapped) return absl::OkStatus();
  const double h = static_cast<double>(hidden),
               approximate_elements = static_cast<double>(layers) *
                                          (4 * h * h + 3 * h * static_cast<double>(ffn) + 2 * h) +
                                      2 * static_cast<double>(vocab) * h + h;
  return absl::InvalidArgumentError(absl::StrCat(
      "synthetic spec '", spec, "' describes about ", absl::SixDigits(approximate_elements),
      " elements, ", absl::SixDigits(approximate_elements * sizeof(float)),
      " bytes of fp32 master, more than a 64-bit size can count (", UINT64_MAX,
      "): use fewer layers or a smaller hidden or ffn"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SyntheticModel>> SyntheticModel::Create(absl::string_view spec) {
  if (!absl::StartsWith(spec, kPrefix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic spec '", spec,
                     "' must start with 'llama:', e.g. "
                     "'llama:layers=8,hidden=2048,ffn=5632,vocab=32000,seed=1'"));
  }
  std::map<std::string, uint64_t> values = {{"layers", 2},   {"hidden", 256}, {"ffn", 688},
                                            {"vocab", 1024}, {"seed", 0},     {"kv", 0}};
  const absl::string_view body = spec.substr(kPrefix.size());
  if (!body.empty()) {
    for (absl::string_view part : absl::StrSplit(body, ',')) {
      std::vector<absl::string_view> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
      auto it = values.end();
      if (kv.size() == 2) it = values.find(std::string(kv[0]));
      if (it == values.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("synthetic spec '", spec, "': '", part,
                         "' is not one of layers=N, hidden=N, ffn=N, vocab=N, kv=N, seed=N"));
      }
      uint64_t v = 0;
      auto [end, ec] = std::from_chars(kv[1].data(), kv[1].data() + kv[1].size(), v);
      const bool is_seed = it->first == "seed";
      if (ec != std::errc() || end != kv[1].data() + kv[1].size() || (!is_seed && v == 0) ||
          (!is_seed && v > (1u << 20))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "synthetic spec '", spec, "': ", it->first, " must be ",
            is_seed ? "an unsigned integer" : "an integer in 1..1048576", ", not '", kv[1], "'"));
      }
      it->second = v;
    }
  }
  RETURN_IF_ERROR(
      CheckSize(spec, values["layers"], values["hidden"], values["ffn"], values["vocab"]));
  const int64_t hidden = static_cast<int64_t>(values["hidden"]);
  const int64_t ffn = static_cast<int64_t>(values["ffn"]);
  const int64_t vocab = static_cast<int64_t>(values["vocab"]);
  // k_proj's and v_proj's rows: kv heads x head dim under grouped-query
  // attention (1024 for Llama-2-70B's 8 x 128), else hidden.
  const int64_t kv = values["kv"] == 0 ? hidden : static_cast<int64_t>(values["kv"]);

  auto model = std::unique_ptr<SyntheticModel>(new SyntheticModel());
  model->seed_ = values["seed"];
  model->model_.model_id = absl::StrCat(
      "synthetic:llama:layers=", values["layers"], ",hidden=", hidden, ",ffn=", ffn,
      ",vocab=", vocab, values["kv"] == 0 ? "" : absl::StrCat(",kv=", kv), ",seed=", model->seed_);
  model->model_.layers.push_back(
      LayerSpec{"model.embed_tokens", {Tensor("model.embed_tokens.weight", {vocab, hidden})}});
  for (uint64_t i = 0; i < values["layers"]; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    // Sorted by name, as layers grouped from a checkpoint are.
    model->model_.layers.push_back(
        LayerSpec{absl::StrCat("model.layers.", i),
                  {
                      Tensor(p + "input_layernorm.weight", {hidden}),
                      Tensor(p + "mlp.down_proj.weight", {hidden, ffn}),
                      Tensor(p + "mlp.gate_proj.weight", {ffn, hidden}),
                      Tensor(p + "mlp.up_proj.weight", {ffn, hidden}),
                      Tensor(p + "post_attention_layernorm.weight", {hidden}),
                      Tensor(p + "self_attn.k_proj.weight", {kv, hidden}),
                      Tensor(p + "self_attn.o_proj.weight", {hidden, hidden}),
                      Tensor(p + "self_attn.q_proj.weight", {hidden, hidden}),
                      Tensor(p + "self_attn.v_proj.weight", {kv, hidden}),
                  }});
  }
  model->model_.layers.push_back(LayerSpec{
      "final", {Tensor("lm_head.weight", {vocab, hidden}), Tensor("model.norm.weight", {hidden})}});
  return model;
}

float SyntheticModel::Value(uint64_t seed, absl::string_view tensor_name, uint64_t index) {
  return ElementValue(SplitMix64(seed ^ NameHash(tensor_name)), IsNorm(tensor_name), index);
}

absl::Status SyntheticModel::Read(uint32_t layer, uint32_t tensor, ElementRange range,
                                  std::span<float> dst) const {
  const TensorSpec& spec = model_.layers[layer].tensors[tensor];
  const uint64_t name_seed = SplitMix64(seed_ ^ NameHash(spec.name));
  const bool norm = IsNorm(spec.name);
  for (uint64_t i = 0; i < range.size(); ++i) {
    dst[i] = ElementValue(name_seed, norm, range.begin + i);
  }
  return absl::OkStatus();
}

}  // namespace layercast
