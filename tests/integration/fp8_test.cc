// fp8 on the wire against real shard processes: a layer in float8_e4m3fn or
// float8_e5m2 arrives as the codes and block scales of quantizing the fp32
// master (core/fp8.h, itself checked over every fp32 input), whole, in byte
// ranges (deltas: fp8_delta_test.cc); a policy's max_rel_error
// refuses what fp8 loses beyond it; a worker trains an fp8 layer from
// float32 gradients; a shard refuses to start when its shard count would
// split a block.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cast_error_report.h"
#include "client/gradient_sink.h"
#include "core/cast.h"
#include "core/fp8.h"
#include "core/policy.h"
#include "layercast/v1/shard.grpc.pb.h"
#include "tests/integration/shard_fixture.h"
#include "tools/synthetic_gradient.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kModel[] = "llama:layers=2,hidden=128,ffn=256,vocab=64";
// Blocks of 32, so small chunks span several; the norms stay bfloat16 beside
// the fp8 tensors.
constexpr char kFp8Policy[] = "p=f32,c=float8_e4m3fn,fp8_block=32;*norm*=bf16";

// Every tensor of every layer in float32, from shards that serve it that
// way: the fp32 master the fp8 shards quantize.
using MasterValues = std::vector<std::vector<std::vector<float>>>;  // [layer][tensor]
MasterValues MasterLayers() {
  RunningShards shards = StartShards(2, {"--synthetic", kModel, "--policy", "f32"});
  EXPECT_NE(shards.set, nullptr);
  MasterValues layers;
  if (shards.set == nullptr) return layers;
  for (uint32_t l = 0; l < shards.set->model().layers.size(); ++l) {
    absl::StatusOr<client::Layer> layer = shards.set->Gather(l);
    EXPECT_TRUE(layer.ok()) << layer.status();
    if (!layer.ok()) return {};
    layers.emplace_back();
    for (size_t t = 0; t < layer->num_tensors(); ++t) {
      const client::Layer::TensorView view = layer->tensor(t);
      const auto* values = reinterpret_cast<const float*>(view.bytes.data());
      layers.back().emplace_back(values, values + view.num_elements);
    }
  }
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
  return layers;
}

// Expects `got` to hold exactly what `policy` makes of `master`: an 8-bit
// tensor's codes and scales as QuantizeFp8 gives them, a 16-bit one's cast.
void ExpectServedAsPolicySays(const client::Layer& got,
                              const std::vector<std::vector<float>>& master, const Policy& policy) {
  ASSERT_EQ(got.num_tensors(), master.size());
  for (size_t t = 0; t < got.num_tensors(); ++t) {
    const client::Layer::TensorView view = got.tensor(t);
    SCOPED_TRACE(std::string(view.name));
    const std::span<const float> values = master[t];
    const DType dtype = policy.ComputeDTypeFor(view.name);
    ASSERT_EQ(view.dtype, dtype);
    if (IsFloat8(dtype)) {
      ASSERT_EQ(view.block_size, policy.fp8_block());
      std::vector<uint8_t> codes(values.size());
      std::vector<float> scales(Fp8BlockCount(values.size(), view.block_size));
      QuantizeFp8(values, view.block_size, Fp8FormatOf(dtype), codes, scales);
      ASSERT_EQ(view.scales.size(), scales.size());
      EXPECT_TRUE(std::equal(codes.begin(), codes.end(), view.bytes.begin()));
      EXPECT_EQ(std::memcmp(view.scales.data(), scales.data(), scales.size() * sizeof(float)), 0);
      // And the pair gives the values back within fp8's precision.
      std::vector<float> back(values.size());
      DequantizeFp8(view.bytes, view.block_size, view.scales, Fp8FormatOf(dtype), back);
      for (size_t i = 0; i < values.size(); i += 97) {
        EXPECT_NEAR(back[i], values[i], std::abs(values[i]) / 8 + 1e-30f) << i;
      }
    } else {
      ASSERT_TRUE(view.scales.empty());
      std::vector<uint8_t> cast(values.size() * DTypeSize(dtype));
      ASSERT_TRUE(
          CastFromF32(values.data(), cast.data(), values.size(), dtype, Fp16Overflow::kError).ok());
      EXPECT_TRUE(std::equal(cast.begin(), cast.end(), view.bytes.begin()));
    }
  }
}

TEST(Fp8WireTest, LayersArriveAsTheQuantizedMasterWholeAndRanged) {
  const MasterValues master = MasterLayers();
  ASSERT_FALSE(master.empty());
  // Small chunks, so a tensor spans several, and ranges that start inside
  // blocks.
  const Policy policy = *Policy::Parse(kFp8Policy);
  RunningShards shards =
      StartShards(2, {"--synthetic", kModel, "--policy", kFp8Policy, "--chunk-bytes", "1000"});
  ASSERT_NE(shards.set, nullptr);
  EXPECT_EQ(shards.set->manifests()[0].policy(), policy.ToString());
  for (uint32_t l = 0; l < master.size(); ++l) {
    SCOPED_TRACE(absl::StrCat("layer ", l));
    absl::StatusOr<client::Layer> whole = shards.set->Gather(l);
    ASSERT_TRUE(whole.ok()) << whole.status();
    ExpectServedAsPolicySays(*whole, master[l], policy);

    // Four byte ranges on 256-byte boundaries, as K local GPUs fetch, into
    // one buffer: each brings the scales of the blocks of its codes.
    const AssembledLayout& layout = shards.set->view().layouts[l];
    absl::StatusOr<client::LayerBuffer> buffer =
        client::LayerBuffer::Allocate(layout.total_bytes());
    ASSERT_TRUE(buffer.ok());
    std::memset(buffer->data(), 0xEE, buffer->size());
    for (const auto& [begin, end] : layout.SplitBytes(4)) {
      if (begin == end) continue;
      client::GatherOptions options;
      options.byte_range = {begin, end};
      ASSERT_TRUE(shards.set->GatherInto(l, options, {buffer->data(), buffer->size()}).ok());
    }
    for (size_t t = 0; t < layout.tensors().size(); ++t) {
      const AssembledTensor& placed = layout.tensors()[t];
      const uint64_t end = placed.block_size == 0 ? placed.byte_offset + placed.num_bytes()
                                                  : placed.scale_offset + placed.scale_bytes();
      EXPECT_TRUE(std::equal(buffer->data() + placed.byte_offset, buffer->data() + end,
                             whole->bytes().data() + placed.byte_offset))
          << "tensor " << t;
    }

    // A range that starts and ends inside blocks: the shard quantizes those
    // elements with their whole blocks' scales.
    for (size_t t = 0; t < layout.tensors().size(); ++t) {
      const AssembledTensor& placed = layout.tensors()[t];
      if (placed.block_size == 0 || placed.num_elements < 3000) continue;
      std::memset(buffer->data(), 0, buffer->size());
      client::GatherOptions options;
      options.byte_range = {placed.byte_offset + 37, placed.byte_offset + 2999};
      ASSERT_TRUE(shards.set->GatherInto(l, options, {buffer->data(), buffer->size()}).ok());
      EXPECT_TRUE(std::equal(buffer->data() + placed.byte_offset + 37,
                             buffer->data() + placed.byte_offset + 2999,
                             whole->bytes().data() + placed.byte_offset + 37))
          << "tensor " << t;
      const uint64_t scales_begin = placed.scale_offset + 37 / placed.block_size * sizeof(float);
      const uint64_t scales_end =
          placed.scale_offset + (2999 + placed.block_size - 1) / placed.block_size * sizeof(float);
      EXPECT_TRUE(std::equal(buffer->data() + scales_begin, buffer->data() + scales_end,
                             whole->bytes().data() + scales_begin))
          << "tensor " << t;
    }
  }
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
}

// `layercast fetch` writes an fp8 layer's codes as F8_E4M3 and each
// tensor's block scales beside it as "<name>_scale" (F32), so the file holds
// what it takes to get the values back.
TEST(Fp8WireTest, FetchWritesCodesAndTheirScales) {
  RunningShards shards =
      StartShards(2, {"--synthetic", kModel, "--policy", "p=f32,c=f8e4m3,fp8_block=64;*norm*=f32"});
  ASSERT_NE(shards.set, nullptr);
  const absl::StatusOr<client::Layer> layer = shards.set->Gather(1);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const std::string path = MakeTempDir("fp8_fetch") + "/layer1.safetensors";
  std::string output;
  ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " fetch --shards ",
                                    absl::StrJoin(shards.processes->addresses(), ","),
                                    " --layer 1 --out ", path),
                       &output),
            0)
      << output;
  std::ifstream in(path, std::ios::binary);
  const std::string file(std::istreambuf_iterator<char>(in), {});
  ASSERT_GE(file.size(), 8u);
  uint64_t header_size = 0;
  std::memcpy(&header_size, file.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(file.substr(8, header_size));
  const std::string data = file.substr(8 + header_size);
  EXPECT_EQ(header["__metadata__"]["fp8_block_size"], "64");
  int fp8 = 0;
  for (size_t t = 0; t < layer->num_tensors(); ++t) {
    const client::Layer::TensorView view = layer->tensor(t);
    const nlohmann::json& entry = header.at(std::string(view.name));
    const auto offsets = entry["data_offsets"].get<std::vector<uint64_t>>();
    EXPECT_EQ(data.substr(offsets[0], offsets[1] - offsets[0]),
              std::string(view.bytes.begin(), view.bytes.end()));
    if (view.block_size == 0) {
      EXPECT_EQ(entry["dtype"], "F32");
      EXPECT_FALSE(header.contains(absl::StrCat(view.name, "_scale")));
      continue;
    }
    ++fp8;
    EXPECT_EQ(entry["dtype"], "F8_E4M3");
    const nlohmann::json& scale = header.at(absl::StrCat(view.name, "_scale"));
    EXPECT_EQ(scale["dtype"], "F32");
    EXPECT_EQ(scale["shape"], nlohmann::json::array({view.scales.size()}));
    const auto scale_offsets = scale["data_offsets"].get<std::vector<uint64_t>>();
    EXPECT_EQ(
        data.substr(scale_offsets[0], scale_offsets[1] - scale_offsets[0]),
        std::string(reinterpret_cast<const char*>(view.scales.data()), view.scales.size_bytes()));
  }
  EXPECT_EQ(fp8, 7) << "the decoder layer's seven projections";
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
}

// A worker trains a layer it is served in fp8: it pushes the gradient in
// the layer's gradient layout (fp8 tensors in float32, the 16-bit norms in
// bfloat16), each shard steps its slice of the fp32 master, and the next
// gather is the quantization of master - lr * gradient, code for code and
// scale for scale. A gradient misplaced by one element, or cut to 16 bits,
// moves some block's scale or code.
TEST(Fp8WireTest, AnFp8LayerTrainsFromFloat32GradientsOnTheMaster) {
  const MasterValues master = MasterLayers();
  ASSERT_FALSE(master.empty());
  const Policy policy = *Policy::Parse(kFp8Policy);
  // lr = 0.5: lr * g is exact, so the step is one fp32 rounding of p - g/2
  // however the optimizer groups it.
  RunningShards shards =
      StartShards(2, {"--synthetic", kModel, "--policy", kFp8Policy, "--optimizer", "sgd:lr=0.5",
                      "--data-parallel-workers", "1", "--chunk-bytes", "1000"});
  ASSERT_NE(shards.set, nullptr);
  const wire::ShardSetView& view = shards.set->view();
  auto sink = client::GradientSink::Create(*shards.set, {.chunk_bytes = 1000});
  ASSERT_TRUE(sink.ok()) << sink.status();
  MasterValues stepped = master;
  for (uint32_t l = 0; l < master.size(); ++l) {
    SCOPED_TRACE(absl::StrCat("layer ", l));
    const AssembledLayout& gradient_layout = view.gradient_layouts[l];
    ASSERT_EQ(gradient_layout.tensors().size(), master[l].size());
    absl::StatusOr<client::LayerBuffer> gradient =
        client::LayerBuffer::Allocate(gradient_layout.total_bytes());
    ASSERT_TRUE(gradient.ok());
    ASSERT_TRUE(
        tools::FillSyntheticGradient(gradient_layout, 0, 0, l, {gradient->data(), gradient->size()})
            .ok());
    for (size_t t = 0; t < master[l].size(); ++t) {
      const AssembledTensor& placed = gradient_layout.tensors()[t];
      const DType served = view.layouts[l].tensors()[t].compute_dtype;
      ASSERT_EQ(placed.compute_dtype, IsFloat8(served) ? DType::kFloat32 : served);
      std::vector<float> g(placed.num_elements);
      CastToF32(gradient->data() + placed.byte_offset, placed.compute_dtype, g.data(), g.size());
      for (size_t i = 0; i < g.size(); ++i) stepped[l][t][i] -= 0.5f * g[i];
    }
    // The gather's layout is the wrong shape for an fp8 layer's gradient.
    if (gradient_layout.total_bytes() != view.layouts[l].total_bytes()) {
      auto wrong = client::LayerBuffer::Allocate(view.layouts[l].total_bytes());
      ASSERT_TRUE(wrong.ok());
      auto refused = (*sink)->Push(l, 0, *std::move(wrong));
      ASSERT_FALSE(refused.ok());
      EXPECT_THAT(std::string(refused.status().message()), HasSubstr("gradient layout"));
    }
    auto pushed = (*sink)->Push(l, 0, *std::move(gradient));
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    ASSERT_TRUE(pushed->get().ok()) << pushed->get().status();
    EXPECT_TRUE(pushed->get()->applied);
  }
  ASSERT_TRUE((*sink)->Flush().ok());
  for (uint32_t l = 0; l < master.size(); ++l) {
    SCOPED_TRACE(absl::StrCat("layer ", l));
    client::GatherOptions options;
    options.min_version = 1;
    absl::StatusOr<client::Layer> layer = shards.set->Gather(l, options);
    ASSERT_TRUE(layer.ok()) << layer.status();
    EXPECT_EQ(layer->version(), 1u);
    ExpectServedAsPolicySays(*layer, stepped[l], policy);
  }
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
}

TEST(Fp8WireTest, MaxRelErrorRefusesWhatE5m2LosesAndTheReportSaysSo) {
  // float8_e5m2 keeps 2 mantissa bits: relative errors up to 2^-3, far
  // beyond 1%. e4m3fn's 3 bits stay within 2^-4 for normal values.
  RunningShards shards = StartShards(
      2, {"--synthetic", kModel, "--policy", "p=f32,c=f8e5m2,max_rel_error=0.01;*norm*=f32"});
  ASSERT_NE(shards.set, nullptr);
  const absl::StatusOr<client::Layer> layer = shards.set->Gather(0);
  ASSERT_FALSE(layer.ok());
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(layer.status().message()),
              HasSubstr("loses too much in its cast to float8_e5m2"));
  EXPECT_THAT(std::string(layer.status().message()),
              HasSubstr("beyond the policy's max_rel_error=0.01"));

  absl::StatusOr<std::vector<client::LayerCastReport>> report =
      client::FetchCastErrorReport(*shards.set);
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_FALSE(report->empty());
  EXPECT_EQ(report->front().dtype, DType::kFloat8E5M2);
  EXPECT_GT(report->front().error.max_relative_error, 0.01f);
  EXPECT_LE(report->front().error.max_relative_error, 0.125f);
  EXPECT_EQ(report->front().error.overflowed, 0u) << "block scales keep every value in range";
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
}

TEST(Fp8WireTest, AShardCountThatSplitsABlockIsRefusedAtStart) {
  // 8192 embedding elements over 3 shards: shard 1 would start at element
  // 2730.
  std::string output;
  const int code = RunCommand(
      absl::StrCat(ShardBinary(), " --listen 127.0.0.1:0 --shard-index 0 --num-shards 3 ",
                   "--synthetic ", kModel, " --policy 'p=f32,c=float8_e4m3fn' 2>&1"),
      &output);
  EXPECT_NE(code, 0);
  EXPECT_THAT(output, HasSubstr("tensor model.embed_tokens.weight (8192 elements) is "
                                "float8_e4m3fn in blocks of 128, but shard 1 of 3 would start at "
                                "element 2730, inside a block"));
  EXPECT_THAT(output, HasSubstr("';model.embed_tokens.weight=bfloat16'"));
}

}  // namespace
}  // namespace layercast::testing
