#pragma once

// PublishTest: two real read-only shards with an admin token, a model to
// publish over, and the checks publish_test.cc, mirror_test.cc and
// pinned_walk_test.cc share.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/model_mirror.h"
#include "client/weight_publisher.h"
#include "core/cast.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"
namespace layercast::testing {

inline constexpr char kToken[] = "publish-token-0123456789abcdef";

class PublishTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = MakeTempDir("publish");
    model_ = WriteTestModel(dir + "/model.safetensors", 2, 17);
    shards_ = StartShards(
        2, {"--model", model_.path, "--policy", "p=f32,c=bf16;*norm*=f32", "--chunk-bytes", "4096",
            "--admin-token-file", WriteAdminToken(dir, kToken)});
    ASSERT_NE(shards_.set, nullptr);
  }

  // The model's values, each nudged by a relative `step` where `pick`.
  std::map<std::string, std::vector<float>> Nudged(float step) const {
    std::map<std::string, std::vector<float>> nudged = model_.values;
    for (auto& [name, values] : nudged) {
      for (size_t i = 0; i < values.size(); i += 3) values[i] *= 1 + step;
    }
    return nudged;
  }

  static client::TensorValues View(const std::map<std::string, std::vector<float>>& values) {
    client::TensorValues view;
    for (const auto& [name, tensor] : values) view.emplace(name, tensor);
    return view;
  }

  uint64_t ManifestVersion(uint32_t shard) const {
    grpc::ClientContext context;
    layercast::v1::Manifest manifest;
    const grpc::Status status = shards_.set->stub(shard).GetManifest(&context, {}, &manifest);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return manifest.version();
  }

  // Every layer gathered whole, and checked against `values` cast to each
  // tensor's compute dtype.
  void ExpectServes(const std::map<std::string, std::vector<float>>& values, uint64_t version) {
    for (uint32_t l = 0; l < shards_.set->model().layers.size(); ++l) {
      absl::StatusOr<client::Layer> layer = shards_.set->Gather(l);
      ASSERT_TRUE(layer.ok()) << layer.status();
      ASSERT_NO_FATAL_FAILURE(ExpectHolds(*layer, values, version));
    }
  }

  // `layer` is at `version` and holds `values` cast to each tensor's
  // compute dtype.
  void ExpectHolds(const client::Layer& layer,
                   const std::map<std::string, std::vector<float>>& values, uint64_t version) {
    EXPECT_EQ(layer.version(), version);
    const AssembledLayout& layout = shards_.set->view().layouts[layer.index()];
    for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
      const AssembledTensor& tensor = layout.tensors()[t];
      const std::string& name = shards_.set->model().layers[layer.index()].tensors[t].name;
      const std::vector<float>& expected = values.at(name);
      std::vector<uint8_t> cast(expected.size() * DTypeSize(tensor.compute_dtype));
      ASSERT_TRUE(CastFromF32(expected.data(), cast.data(), expected.size(), tensor.compute_dtype,
                              Fp16Overflow::kInfinity)
                      .ok());
      ASSERT_EQ(std::memcmp(layer.bytes().data() + tensor.byte_offset, cast.data(), cast.size()), 0)
          << name << " at version " << version;
    }
  }

  // Layer `layer` as a full pull gives it now, padding zeroed.
  std::vector<uint8_t> Bytes(uint32_t layer) const {
    std::vector<uint8_t> bytes(shards_.set->view().layouts[layer].total_bytes());
    const absl::StatusOr<uint64_t> version = shards_.set->GatherInto(layer, {}, bytes);
    EXPECT_TRUE(version.ok()) << version.status();
    return bytes;
  }

  // A mirror's `held` layer has every tensor's bytes as a full pull gives
  // them now (padding aside).
  void ExpectHoldsAFullPull(const client::Layer& held) const {
    const std::vector<uint8_t> full = Bytes(held.index());
    for (size_t t = 0; t < held.num_tensors(); ++t) {
      const std::span<const uint8_t> tensor = held.tensor(t).bytes;
      EXPECT_EQ(std::memcmp(tensor.data(), full.data() + (tensor.data() - held.bytes().data()),
                            tensor.size()),
                0)
          << held.tensor(t).name << " at version " << held.version();
    }
  }

  std::unique_ptr<layercast::v1::ShardAdmin::Stub> Admin(uint32_t shard) const {
    return layercast::v1::ShardAdmin::NewStub(shards_.set->channel(shard));
  }
  static void Authorize(grpc::ClientContext& context) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  }

  TestModel model_;
  RunningShards shards_;
};

}  // namespace layercast::testing
