// Real shard processes over a real safetensors file: every byte of every
// gathered layer equals the core cast of the original fp32 values.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "core/cast.h"
#include "core/policy.h"
#include "core/safetensors.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kPolicy[] = "p=f32,c=bf16;*norm*=f32;lm_head.*=f16";

// The bytes a tensor must arrive as: the core cast of its fp32 master.
std::vector<uint8_t> ExpectedBytes(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  EXPECT_TRUE(
      CastFromF32(values.data(), bytes.data(), values.size(), dtype, Fp16Overflow::kSaturate).ok());
  return bytes;
}

class GatherTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GatherTest, EveryLayerBitExactWithMixedDTypes) {
  const uint32_t num_shards = GetParam();
  const TestModel model = WriteTestModel(MakeTempDir("model") + "/model.safetensors", 3, 42);
  RunningShards shards =
      StartShards(num_shards, {"--model", model.path, "--policy",
                               "p=f32,c=bf16,overflow=saturate;*norm*=f32;lm_head.*=f16",
                               "--chunk-bytes", "1000"});
  ASSERT_NE(shards.set, nullptr);
  const Policy policy = *Policy::Parse(kPolicy);

  const ModelSpec& spec = shards.set->model();
  ASSERT_EQ(spec.layers.size(), 5u);
  EXPECT_EQ(spec.layers[0].name, "model.embed_tokens");
  EXPECT_EQ(spec.layers[3].name, "model.layers.2");
  EXPECT_EQ(spec.layers[4].name, "final");
  std::set<DType> dtypes_seen;
  for (uint32_t l = 0; l < spec.layers.size(); ++l) {
    absl::StatusOr<client::Layer> layer = shards.set->Gather(l);
    ASSERT_TRUE(layer.ok()) << layer.status();
    EXPECT_EQ(layer->version(), 0u);
    ASSERT_EQ(layer->num_tensors(), spec.layers[l].tensors.size());
    for (size_t t = 0; t < layer->num_tensors(); ++t) {
      const client::Layer::TensorView view = layer->tensor(t);
      const std::string name(view.name);
      EXPECT_EQ(view.dtype, policy.ComputeDTypeFor(name)) << name;
      dtypes_seen.insert(view.dtype);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(view.bytes.data()) % 256, 0u) << name;
      const std::vector<uint8_t> expected = ExpectedBytes(model.values.at(name), view.dtype);
      ASSERT_EQ(view.bytes.size(), expected.size()) << name;
      ASSERT_EQ(std::memcmp(view.bytes.data(), expected.data(), expected.size()), 0)
          << name << " differs with " << num_shards << " shards";
    }
  }
  EXPECT_EQ(dtypes_seen.size(), 3u) << "bf16, f32 and f16 tensors were all covered";
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
}

INSTANTIATE_TEST_SUITE_P(Shards, GatherTest, ::testing::Values(1u, 3u, 4u));

TEST(GatherRangeTest, ByteRangesTileTheLayerAcrossKParts) {
  const TestModel model = WriteTestModel(MakeTempDir("model") + "/model.safetensors", 1, 7);
  RunningShards shards = StartShards(3, {"--model", model.path, "--policy", kPolicy});
  ASSERT_NE(shards.set, nullptr);
  const uint32_t layer = 1;
  absl::StatusOr<client::Layer> whole = shards.set->Gather(layer);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const AssembledLayout& layout = shards.set->view().layouts[layer];
  for (uint32_t parts : {2u, 3u, 5u}) {
    std::vector<uint8_t> pieced(layout.total_bytes(), 0);
    std::vector<uint8_t> whole_bytes(whole->bytes().begin(), whole->bytes().end());
    for (auto [begin, end] : layout.SplitBytes(parts)) {
      if (begin == end) continue;
      client::GatherOptions options;
      options.byte_range = {begin, end};
      ASSERT_TRUE(shards.set->GatherInto(layer, options, pieced).ok());
    }
    // Padding is never written: compare tensor bytes only.
    for (const AssembledTensor& t : layout.tensors()) {
      ASSERT_EQ(std::memcmp(pieced.data() + t.byte_offset, whole_bytes.data() + t.byte_offset,
                            t.num_bytes()),
                0)
          << parts << " parts";
    }
  }
}

TEST(GatherCliTest, FetchWritesTheLayerAsSafetensors) {
  const std::string dir = MakeTempDir("cli");
  const TestModel model = WriteTestModel(dir + "/model.safetensors", 2, 3);
  RunningShards shards = StartShards(2, {"--model", model.path, "--policy", kPolicy});
  ASSERT_NE(shards.set, nullptr);
  const std::string list =
      shards.processes->addresses()[0] + "," + shards.processes->addresses()[1];
  std::string output;
  ASSERT_EQ(RunCommand(CliBinary() + " fetch --shards " + list + " --layer 2 --out " + dir +
                           "/layer2.safetensors",
                       &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("wrote layer 2 (model.layers.1"));
  auto reader = SafetensorsReader::Open(dir + "/layer2.safetensors");
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->metadata().at("layer_name"), "model.layers.1");
  const Policy policy = *Policy::Parse(kPolicy);
  ASSERT_EQ((*reader)->tensors().size(), 7u);
  for (const SafetensorsTensor& tensor : (*reader)->tensors()) {
    EXPECT_EQ(tensor.dtype, policy.ComputeDTypeFor(tensor.name)) << tensor.name;
    std::vector<float> read(tensor.num_elements);
    ASSERT_TRUE((*reader)->ReadF32(tensor, ElementRange{0, tensor.num_elements}, read).ok());
    // Widening the written bytes gives back exactly the cast of the master.
    const std::vector<uint8_t> expected = ExpectedBytes(model.values.at(tensor.name), tensor.dtype);
    std::vector<float> widened(tensor.num_elements);
    CastToF32(expected.data(), tensor.dtype, widened.data(), tensor.num_elements);
    ASSERT_EQ(std::memcmp(read.data(), widened.data(), read.size() * 4), 0) << tensor.name;
  }

  ASSERT_EQ(RunCommand(CliBinary() + " manifest --shards " + list, &output), 0) << output;
  EXPECT_THAT(output, HasSubstr("model.layers.1.self_attn.k_proj.weight"));
  EXPECT_THAT(output, HasSubstr("params=float32,compute=bfloat16,output=bfloat16;*norm*=float32"));
}

}  // namespace
}  // namespace layercast::testing
