// CheckManifest against manifests forged to pass every check a shard's own
// code would make: offsets and sizes laid out with the wrapping arithmetic a
// forger may use, and a layout digest recomputed to match them.

#include "wire/manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <string>
#include <vector>

#include "core/layout.h"
#include "core/policy.h"
#include "core/synthetic_model.h"

namespace layercast::wire {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct ForgedTensor {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t num_elements = 0;
  layercast::v1::DType dtype = layercast::v1::FLOAT32;
};

uint64_t Size(layercast::v1::DType dtype) { return dtype == layercast::v1::FLOAT32 ? 4 : 2; }

// LayoutDigest's serialisation, written out again so a test can sign a layout
// the library refuses to build (ForgerDigestMatchesLayoutDigest keeps the two
// in step).
class ForgerDigest {
 public:
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i) bytes_.push_back(static_cast<char>(v >> (8 * i)));
  }
  void Str(const std::string& s) {
    U64(s.size());
    bytes_ += s;
  }
  std::string Finish() const {
    unsigned char digest[32];
    unsigned int length = 0;
    EVP_Digest(bytes_.data(), bytes_.size(), digest, &length, EVP_sha256(), nullptr);
    return std::string(reinterpret_cast<char*>(digest), length);
  }

 private:
  std::string bytes_;
};

// A one-shard f32 manifest whose offsets, assembled sizes and digest follow
// from `layers` with unchecked uint64 arithmetic, as a forger computes them.
layercast::v1::Manifest Forge(const std::vector<std::vector<ForgedTensor>>& layers) {
  layercast::v1::Manifest manifest;
  manifest.set_model_id("forged");
  manifest.set_num_shards(1);
  manifest.set_shard_index(0);
  manifest.set_policy("c=f32");
  ForgerDigest digest;
  digest.U64(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    layercast::v1::Layer* layer = manifest.add_layers();
    layer->set_index(static_cast<uint32_t>(l));
    layer->set_name("layer" + std::to_string(l));
    std::vector<uint64_t> offsets;
    uint64_t offset = 0;
    for (const ForgedTensor& tensor : layers[l]) {
      offsets.push_back(offset);
      offset = (offset + tensor.num_elements * Size(tensor.dtype) + 255) / 256 * 256;
    }
    layer->set_assembled_bytes(offset);
    digest.Str(layer->name());
    digest.U64(layers[l].size());
    digest.U64(offset);
    for (size_t t = 0; t < layers[l].size(); ++t) {
      const ForgedTensor& spec = layers[l][t];
      layercast::v1::Tensor* tensor = layer->add_tensors();
      tensor->set_name(spec.name);
      for (int64_t dim : spec.shape) tensor->add_shape(dim);
      tensor->set_param_dtype(layercast::v1::FLOAT32);
      tensor->set_compute_dtype(spec.dtype);
      tensor->set_byte_offset(offsets[t]);
      tensor->set_num_elements(spec.num_elements);
      digest.Str(spec.name);
      digest.U64(spec.shape.size());
      for (int64_t dim : spec.shape) digest.U64(static_cast<uint64_t>(dim));
      digest.U64(static_cast<uint64_t>(spec.dtype));
      digest.U64(offsets[t]);
      digest.U64(spec.num_elements);
    }
  }
  manifest.set_layout_digest(digest.Finish());
  return manifest;
}

ForgedTensor F32(std::string name, uint64_t n) {
  return ForgedTensor{std::move(name), {static_cast<int64_t>(n)}, n, layercast::v1::FLOAT32};
}

// The two halves of the contract: what a shard builds, a worker accepts, and
// recomputes every layout the shard stated.
TEST(ManifestTest, WhatAShardBuildsAWorkerAccepts) {
  auto model = SyntheticModel::Create("llama:layers=2,hidden=8,ffn=12,vocab=10");
  ASSERT_TRUE(model.ok()) << model.status();
  const absl::StatusOr<Policy> policy = Policy::Parse("p=f32,c=bf16;*norm*=f32");
  ASSERT_TRUE(policy.ok());
  const ModelSpec& spec = (*model)->model();
  std::vector<AssembledLayout> layouts;
  for (const LayerSpec& layer : spec.layers) {
    absl::StatusOr<AssembledLayout> layout = AssembledLayout::Build(layer, *policy);
    ASSERT_TRUE(layout.ok());
    layouts.push_back(*std::move(layout));
  }
  const absl::StatusOr<std::array<uint8_t, 32>> digest = LayoutDigest(spec, *policy);
  ASSERT_TRUE(digest.ok());
  const layercast::v1::Manifest manifest = BuildManifest({.model = &spec,
                                                          .policy = &*policy,
                                                          .layouts = layouts,
                                                          .num_shards = 3,
                                                          .shard_index = 1,
                                                          .layout_digest = *digest,
                                                          .incarnation = 7,
                                                          .data_parallel_workers = 2,
                                                          .optimizer = "sgd:lr=0.5"});
  EXPECT_EQ(manifest.data_parallel_workers(), 2u);
  EXPECT_EQ(manifest.optimizer(), "sgd:lr=0.5");
  const absl::StatusOr<ShardSetView> view = CheckManifest(manifest);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->num_shards, 3u);
  ASSERT_EQ(view->layouts.size(), layouts.size());
  for (size_t l = 0; l < layouts.size(); ++l) {
    EXPECT_EQ(view->layouts[l].total_bytes(), layouts[l].total_bytes()) << "layer " << l;
  }
  // A field changed on the way is caught.
  layercast::v1::Manifest changed = manifest;
  changed.mutable_layers(0)->mutable_tensors(0)->set_byte_offset(2);
  EXPECT_FALSE(CheckManifest(changed).ok());
}

// A relay holding the set in another dtype (held_dtype) lists every tensor
// as it holds it, laid out as a pull in that dtype; the policy, the digest
// and the view a reader works from stay the shards'.
TEST(ManifestTest, ARelayListsTheDtypeItHoldsAndTheViewStaysThePolicys) {
  auto model = SyntheticModel::Create("llama:layers=2,hidden=64,ffn=96,vocab=10");
  ASSERT_TRUE(model.ok()) << model.status();
  const absl::StatusOr<Policy> policy = Policy::Parse("p=f32,c=bf16,fp8_block=32;*norm*=f32");
  ASSERT_TRUE(policy.ok());
  const ModelSpec& spec = (*model)->model();
  std::vector<AssembledLayout> layouts;
  for (const LayerSpec& layer : spec.layers) {
    absl::StatusOr<AssembledLayout> layout = AssembledLayout::Build(layer, *policy);
    ASSERT_TRUE(layout.ok());
    layouts.push_back(*std::move(layout));
  }
  const absl::StatusOr<std::array<uint8_t, 32>> digest = LayoutDigest(spec, *policy);
  ASSERT_TRUE(digest.ok());
  const layercast::v1::Manifest shards = BuildManifest({.model = &spec,
                                                        .policy = &*policy,
                                                        .layouts = layouts,
                                                        .layout_digest = *digest,
                                                        .optimizer = ""});
  layercast::v1::Manifest relay = shards;
  relay.set_held_dtype(layercast::v1::FLOAT8_E4M3FN);
  // The shards' figures under a held_dtype: they say bfloat16, not what it holds.
  absl::StatusOr<ShardSetView> view = CheckManifest(relay);
  ASSERT_FALSE(view.ok());
  EXPECT_THAT(view.status().message(), HasSubstr("but the held_dtype is float8_e4m3fn"));

  for (int l = 0; l < relay.layers_size(); ++l) {
    const absl::StatusOr<AssembledLayout> held =
        LayoutIn(layouts[l], DType::kFloat8E4M3FN, policy->fp8_block());
    ASSERT_TRUE(held.ok());
    layercast::v1::Layer& layer = *relay.mutable_layers(l);
    layer.set_assembled_bytes(held->total_bytes());
    for (int t = 0; t < layer.tensors_size(); ++t) {
      layer.mutable_tensors(t)->set_compute_dtype(layercast::v1::FLOAT8_E4M3FN);
      layer.mutable_tensors(t)->set_byte_offset(held->tensors()[t].byte_offset);
      layer.mutable_tensors(t)->set_block_size(held->tensors()[t].block_size);
      layer.mutable_tensors(t)->set_scale_offset(held->tensors()[t].scale_offset);
    }
  }
  view = CheckManifest(relay);
  ASSERT_TRUE(view.ok()) << view.status();
  for (size_t l = 0; l < layouts.size(); ++l) {
    ASSERT_EQ(view->layouts[l].tensors().size(), layouts[l].tensors().size());
    for (size_t t = 0; t < layouts[l].tensors().size(); ++t) {
      EXPECT_EQ(view->layouts[l].tensors()[t].compute_dtype, layouts[l].tensors()[t].compute_dtype);
    }
    EXPECT_EQ(view->layouts[l].total_bytes(), layouts[l].total_bytes()) << "layer " << l;
  }

  // fp8 dtypes at the bfloat16 layout's offsets are refused.
  layercast::v1::Manifest misplaced = relay;
  misplaced.mutable_layers(1)->set_assembled_bytes(shards.layers(1).assembled_bytes());
  EXPECT_FALSE(CheckManifest(misplaced).ok());
}

TEST(ManifestCheckTest, ForgerDigestMatchesLayoutDigest) {
  // An honest layout: the forger's digest is the library's, so the refusals
  // below are not digest mismatches.
  const layercast::v1::Manifest manifest =
      Forge({{F32("a", 1000), F32("b", 3)}, {}, {F32("c", 1)}});
  absl::StatusOr<ShardSetView> view = CheckManifest(manifest);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->layouts[0].total_bytes(), 4096u + 256);
}

TEST(ManifestCheckTest, RefusesALayerWhoseSizeWrapsPast2To64) {
  // 16384 tensors of 2^48 fp32 elements take 2^64 bytes: with wrapping
  // arithmetic the layer is 256 bytes (the last tensor's), its digest
  // matches, and tensor 0 would be a 2^50-byte span of a 256-byte buffer.
  std::vector<ForgedTensor> tensors;
  for (int i = 0; i < 16384; ++i)
    tensors.push_back(F32("t" + std::to_string(i), uint64_t{1} << 48));
  tensors.push_back(F32("bias", 1));
  const layercast::v1::Manifest manifest = Forge({tensors});
  ASSERT_EQ(manifest.layers(0).assembled_bytes(), 256u);
  const absl::Status status = CheckManifest(manifest).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("inconsistent manifest: layer 0 (layer0): tensor 0 of "
                                          "16385 has 281474976710656 float32 elements"));
  EXPECT_THAT(status.message(), HasSubstr("281474976710656 bytes (256.00 TiB)"));
  EXPECT_THAT(status.message(), Not(HasSubstr("layout_digest")));
}

TEST(ManifestCheckTest, RefusesALayerLargerThanTheCapWithoutWrapping) {
  // Three tensors of 2^47 bytes: each fits, the layer of 384 TiB does not.
  const uint64_t n = uint64_t{1} << 45;
  const absl::Status status =
      CheckManifest(Forge({{F32("a", n), F32("b", n), F32("c", n)}})).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("tensors 0-2 of 3 take 422212465065984 bytes"));
  EXPECT_THAT(status.message(), HasSubstr("281474976710656 bytes (256.00 TiB)"));
  // Exactly the cap is a layer like any other.
  absl::StatusOr<ShardSetView> at_cap = CheckManifest(Forge({{F32("a", n), F32("b", n)}}));
  ASSERT_TRUE(at_cap.ok()) << at_cap.status();
  EXPECT_EQ(at_cap->layouts[0].total_bytes(), uint64_t{1} << 48);
}

TEST(ManifestCheckTest, RefusesMoreLayersThanTheCap) {
  const layercast::v1::Manifest manifest =
      Forge(std::vector<std::vector<ForgedTensor>>(kMaxManifestLayers + 1));
  const absl::Status status = CheckManifest(manifest).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(),
              HasSubstr("it lists 65537 layers, more than a worker accepts (65536)"));
  EXPECT_TRUE(
      CheckManifest(Forge(std::vector<std::vector<ForgedTensor>>(kMaxManifestLayers))).ok());
}

TEST(ManifestCheckTest, RefusesMoreTensorsThanTheCap) {
  std::vector<std::vector<ForgedTensor>> layers(2);
  for (uint64_t i = 0; i <= kMaxManifestTensors; ++i) layers[i % 2].push_back(F32("t", 0));
  const absl::Status status = CheckManifest(Forge(layers)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(),
              HasSubstr("it lists 1048577 tensors, more than a worker accepts (1048576)"));
}

// An honest 8-bit float layout for 2 shards (512 elements in blocks of 128),
// signed with the library's own digest, then announced as 3 shards: shard 1
// would start at element 170, inside a block, so two shards would send
// scales for it.
TEST(ManifestCheckTest, RefusesAShardCountThatSplitsAFloat8Block) {
  const absl::StatusOr<Policy> policy = Policy::Parse("p=f32,c=float8_e4m3fn,fp8_block=128");
  ASSERT_TRUE(policy.ok()) << policy.status();
  const ModelSpec model{"m", {LayerSpec{"layer0", {TensorSpec{"w", {512}, 512}}}}};
  const absl::StatusOr<AssembledLayout> layout =
      AssembledLayout::FromDTypes({DType::kFloat8E4M3FN}, {512}, 128);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const absl::StatusOr<std::array<uint8_t, 32>> digest = LayoutDigest(model, *policy);
  ASSERT_TRUE(digest.ok()) << digest.status();

  layercast::v1::Manifest manifest;
  manifest.set_model_id("m");
  manifest.set_num_shards(2);
  manifest.set_shard_index(0);
  manifest.set_policy(policy->ToString());
  manifest.set_layout_digest(std::string(digest->begin(), digest->end()));
  layercast::v1::Layer* layer = manifest.add_layers();
  layer->set_index(0);
  layer->set_name("layer0");
  layer->set_assembled_bytes(layout->total_bytes());
  layercast::v1::Tensor* tensor = layer->add_tensors();
  tensor->set_name("w");
  tensor->add_shape(512);
  tensor->set_param_dtype(layercast::v1::FLOAT32);
  tensor->set_compute_dtype(layercast::v1::FLOAT8_E4M3FN);
  tensor->set_byte_offset(layout->tensors()[0].byte_offset);
  tensor->set_num_elements(512);
  tensor->set_block_size(layout->tensors()[0].block_size);
  tensor->set_scale_offset(layout->tensors()[0].scale_offset);
  ASSERT_TRUE(CheckManifest(manifest).ok()) << CheckManifest(manifest).status();

  manifest.set_num_shards(3);
  const absl::StatusOr<ShardSetView> view = CheckManifest(manifest);
  ASSERT_FALSE(view.ok());
  EXPECT_THAT(view.status().message(), HasSubstr("would start at element 170, inside a block"));
}

}  // namespace
}  // namespace layercast::wire
