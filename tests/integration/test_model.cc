#include "tests/integration/test_model.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/cast.h"
#include "core/safetensors.h"

namespace layercast::testing {
namespace {

struct Planned {
  std::string name;
  std::vector<int64_t> shape;
  DType stored;
};

float InterestingValue(std::mt19937_64& rng) {
  switch (rng() % 8) {
    case 0: {  // a bf16 tie: the low 16 bits exactly 0x8000
      uint32_t bits = (static_cast<uint32_t>(rng()) & 0x3FFF0000u) | 0x8000u;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case 1: {  // an fp32 subnormal
      uint32_t bits = static_cast<uint32_t>(rng()) & 0x807FFFFFu;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case 2:
      return std::uniform_real_distribution<float>(-1e4f, 1e4f)(rng);
    default:
      return std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng);
  }
}

}  // namespace

TestModel WriteTestModel(const std::string& path, int num_layers, uint64_t seed) {
  constexpr int64_t kHidden = 67, kFfn = 131, kVocab = 97;
  std::vector<Planned> planned = {
      {"model.embed_tokens.weight", {kVocab, kHidden}, DType::kFloat32}};
  for (int i = 0; i < num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    planned.push_back({p + "input_layernorm.weight", {kHidden}, DType::kFloat32});
    planned.push_back({p + "self_attn.q_proj.weight", {kHidden, kHidden}, DType::kFloat32});
    planned.push_back({p + "self_attn.k_proj.weight", {kHidden, kHidden}, DType::kBFloat16});
    planned.push_back({p + "mlp.up_proj.weight", {kFfn, kHidden}, DType::kFloat32});
    planned.push_back({p + "mlp.down_proj.weight", {kHidden, kFfn}, DType::kFloat16});
    planned.push_back({p + "post_attention_layernorm.weight", {kHidden}, DType::kFloat32});
    planned.push_back({p + "self_attn.rotary.scale", {}, DType::kFloat32});  // a scalar
  }
  planned.push_back({"model.norm.weight", {kHidden}, DType::kFloat32});
  planned.push_back({"lm_head.weight", {kVocab, kHidden}, DType::kFloat32});

  TestModel model;
  model.path = path;
  std::mt19937_64 rng(seed);
  std::vector<SafetensorsWriter::TensorHeader> headers;
  std::vector<std::vector<uint8_t>> stored;
  for (const Planned& p : planned) {
    uint64_t n = 1;
    for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
    std::vector<float> values(n);
    for (float& v : values) v = InterestingValue(rng);
    std::vector<uint8_t> bytes(n * DTypeSize(p.stored));
    if (p.stored == DType::kFloat32) {
      std::memcpy(bytes.data(), values.data(), bytes.size());
    } else {
      // Store in 16 bits and keep, as the master, exactly what widening gives.
      EXPECT_TRUE(
          CastFromF32(values.data(), bytes.data(), n, p.stored, Fp16Overflow::kSaturate).ok());
      CastToF32(bytes.data(), p.stored, values.data(), n);
    }
    headers.push_back({p.name, p.stored, p.shape});
    stored.push_back(std::move(bytes));
    model.values[p.name] = std::move(values);
  }
  auto writer = SafetensorsWriter::Create(path, headers, {{"format", "pt"}});
  EXPECT_TRUE(writer.ok()) << writer.status();
  for (const auto& bytes : stored) EXPECT_TRUE((*writer)->Append(bytes).ok());
  EXPECT_TRUE((*writer)->Finish().ok());
  return model;
}

}  // namespace layercast::testing
