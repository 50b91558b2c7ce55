// ParameterStore's sizes for models too large to count: refused with the
// figure before anything is allocated, never wrapped.

#include "server/serving/parameter_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace layercast::server {
namespace {

using ::testing::HasSubstr;

// A source whose model is all that is asked of it: Load must refuse the
// model before reading (and allocating) anything.
class SpecOnlySource final : public ParameterSource {
 public:
  explicit SpecOnlySource(ModelSpec model) : model_(std::move(model)) {}
  const ModelSpec& model() const override { return model_; }
  absl::Status Read(uint32_t, uint32_t, ElementRange, std::span<float>) const override {
    return absl::InternalError("a model too large to count was read");
  }

 private:
  ModelSpec model_;
};

// `layers` layers of one tensor of `n` elements each.
ModelSpec Uniform(uint32_t layers, uint64_t n) {
  ModelSpec model{"huge", {}};
  for (uint32_t l = 0; l < layers; ++l) {
    model.layers.push_back(LayerSpec{absl::StrCat("l", l), {TensorSpec{"w", {}, n}}});
  }
  return model;
}

TEST(ParameterStoreTest, MasterBytesRefusesASizePast2To64) {
  // 2^15 layers of 2^47 elements: 2^62 elements, 2^64 bytes of fp32.
  const ModelSpec model = Uniform(1 << 15, uint64_t{1} << 47);
  const absl::StatusOr<uint64_t> one_shard = ParameterStore::MasterBytes(model, 0, 1);
  EXPECT_EQ(one_shard.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(one_shard.status().message(),
              HasSubstr("model 'huge' is too large: shard 0 of 1 would hold about 1.84467e+19 "
                        "bytes of fp32 master, more than a 64-bit size can count"));
  // Each of two shards holds half: 2^63 bytes, which is a size.
  const absl::StatusOr<uint64_t> half = ParameterStore::MasterBytes(model, 1, 2);
  ASSERT_TRUE(half.ok()) << half.status();
  EXPECT_EQ(*half, uint64_t{1} << 63);
}

TEST(ParameterStoreTest, LoadRefusesAModelItCannotCount) {
  // Every layer lays out (2^48 bytes of bf16), but the fp32 master of all of
  // them does not fit in 64 bits.
  const SpecOnlySource wraps(Uniform(1 << 15, uint64_t{1} << 47));
  auto store = ParameterStore::Load(wraps, 0, 1, *Policy::Parse("c=bf16"));
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(store.status().message(), HasSubstr("more than a 64-bit size can count"));
  // One layer larger than any layer may be.
  const SpecOnlySource too_large(Uniform(1, uint64_t{1} << 47));
  store = ParameterStore::Load(too_large, 0, 1, *Policy::Parse("c=f32"));
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(store.status().message(),
              HasSubstr("layer l0: tensor 0 of 1 has 140737488355328 float32 elements, "
                        "562949953421312 bytes (512.00 TiB), more than the most one layer may "
                        "assemble to"));
}

}  // namespace
}  // namespace layercast::server
