// Writes the seed corpora under tests/fuzz/corpus/ (committed; run again only
// to change them):  make_fuzz_seeds OUT_DIR
// Valid seeds come from the project's own writers (SafetensorsWriter,
// BuildManifest, the request messages), so they follow the formats exactly;
// invalid ones are each a valid seed with one thing broken.

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/crc32c.h"
#include "core/safetensors.h"
#include "core/synthetic_model.h"
#include "layercast/v1/admin.pb.h"
#include "server/serving/parameter_store.h"
#include "server/shard/shard_service.h"
#include "tests/fuzz/publish_stage_fixture.h"
#include "tests/fuzz/safetensors_input.h"
#include "wire/chunk_encoder.h"
#include "wire/gradient_chunks.h"

namespace layercast::fuzz {
namespace {

namespace fs = std::filesystem;

void Write(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream out;
  out << in.rdbuf();
  return out.str();
}

struct Tensor {
  SafetensorsWriter::TensorHeader header;
  std::string bytes;
};

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

std::string Safetensors(const fs::path& scratch, const std::vector<Tensor>& tensors,
                        const std::map<std::string, std::string>& metadata = {}) {
  std::vector<SafetensorsWriter::TensorHeader> headers;
  for (const Tensor& tensor : tensors) headers.push_back(tensor.header);
  const std::string path = (scratch / "seed.safetensors").string();
  auto writer = SafetensorsWriter::Create(path, headers, metadata);
  if (!writer.ok()) {
    std::fprintf(stderr, "%s\n", writer.status().ToString().c_str());
    std::exit(1);
  }
  for (const Tensor& tensor : tensors) {
    if (!(*writer)
             ->Append({reinterpret_cast<const uint8_t*>(tensor.bytes.data()), tensor.bytes.size()})
             .ok()) {
      std::exit(1);
    }
  }
  if (!(*writer)->Finish().ok()) std::exit(1);
  std::string out = ReadAll(path);
  fs::remove(path);
  return out;
}

void SafetensorsSeeds(const fs::path& dir, const fs::path& scratch) {
  const Tensor f32{{"model.layers.0.mlp.up_proj.weight", DType::kFloat32, {2, 3}},
                   Bytes<float>({1.0f, -2.5f, 3.0e-39f, 65504.0f, 1e30f, -0.0f})};
  // bf16: 1, -inf, a quiet NaN, a subnormal; f16: 1, the smallest subnormal,
  // a signalling NaN, 65504.
  const Tensor bf16{{"model.layers.0.input_layernorm.weight", DType::kBFloat16, {4}},
                    Bytes<uint16_t>({0x3F80, 0xFF80, 0x7FC1, 0x0001})};
  const Tensor f16{{"lm_head.weight", DType::kFloat16, {2, 2}},
                   Bytes<uint16_t>({0x3C00, 0x0001, 0x7D01, 0x7BFF})};
  const Tensor scalar{{"scalar", DType::kFloat32, {}}, Bytes<float>({42.0f})};
  const Tensor empty{{"empty", DType::kFloat16, {0, 7}}, ""};

  const std::string one = Safetensors(scratch, {f32});
  Write(dir, "valid_f32", one);
  Write(dir, "valid_mixed", Safetensors(scratch, {f32, bf16, f16}, {{"format", "pt"}}));
  Write(dir, "valid_scalar_empty", Safetensors(scratch, {scalar, empty, bf16}));
  Write(dir, "valid_no_tensors", Safetensors(scratch, {}, {{"format", "pt"}}));

  // Multi-file: an index and two files.
  const std::string index =
      R"({"metadata": {"total_size": 48}, "weight_map": {"model.layers.0.mlp.up_proj.weight": ")" +
      ShardName(1) + R"(", "lm_head.weight": ")" + ShardName(2) +
      R"(", "model.layers.0.input_layernorm.weight": ")" + ShardName(2) + R"("}})";
  Write(dir, "valid_index",
        JoinInput(index, {Safetensors(scratch, {f32}), Safetensors(scratch, {f16, bf16})}));
  Write(dir, "invalid_index_escapes",
        JoinInput(R"({"weight_map": {"x": "../x.safetensors"}})", {one}));
  Write(dir, "invalid_index_missing_tensor",
        JoinInput(R"({"weight_map": {"y": ")" + ShardName(1) + R"("}})", {one}));

  // Broken single files.
  Write(dir, "invalid_truncated", one.substr(0, one.size() - 4));
  Write(dir, "invalid_short", one.substr(0, 5));
  std::string huge = one;
  huge[7] = '\x7f';  // an enormous header length
  Write(dir, "invalid_header_length", huge);
  auto with_header = [](const std::string& json, size_t data_bytes) {
    std::string out(8, '\0');
    const uint64_t n = json.size();
    std::memcpy(out.data(), &n, 8);
    return out + json + std::string(data_bytes, '\x3f');
  };
  Write(dir, "invalid_overlap",
        with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                    12));
  Write(dir, "invalid_dtype",
        with_header(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8));
  Write(dir, "invalid_shape_overflow",
        with_header(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                    8));
  Write(dir, "invalid_duplicate",
        with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                    R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                    8));
  Write(dir, "invalid_json", with_header(R"({"a":{"dtype":"F32","shape":[1],"data_of)", 4));
}

void PolicySeeds(const fs::path& dir) {
  const std::map<std::string, std::string> seeds = {
      {"valid_jmp", "params=float32,compute=bfloat16,output=float32"},
      {"valid_short", "p=f32,c=bf16,o=f32"},
      {"valid_bare", "bf16"},
      {"valid_overrides", "p=f32,c=bf16;*norm*=f32;lm_head.*=f32"},
      {"valid_overflow", "p=f32,c=f16,overflow=saturate;model.layers.[0-3].*=bf16"},
      {"valid_repeated", "c=f16,c=bfloat16,overflow=inf,o=full"},
      {"invalid_dtype", "c=bf8"},
      {"invalid_half", "half"},
      {"invalid_empty_pair", "p=f32,,c=bf16"},
      {"invalid_key", "compute=bf16,frobnicate=f32"},
      {"invalid_override", "f32;*norm*"},
      {"invalid_empty", ""},
  };
  for (const auto& [name, text] : seeds) Write(dir, name, text);
}

std::unique_ptr<server::ParameterStore> Store(const std::string& spec, const std::string& policy,
                                              uint32_t shard, uint32_t num_shards) {
  auto model = SyntheticModel::Create(spec);
  auto parsed = Policy::Parse(policy);
  if (!model.ok() || !parsed.ok()) std::exit(1);
  auto store = server::ParameterStore::Load(**model, shard, num_shards, *parsed);
  if (!store.ok()) std::exit(1);
  return *std::move(store);
}

void ManifestSeeds(const fs::path& dir) {
  const std::string tiny = "llama:layers=1,hidden=8,ffn=12,vocab=10";
  const layercast::v1::Manifest bf16 =
      server::BuildManifest(*Store(tiny, "p=f32,c=bf16;*norm*=f32", 1, 2), nullptr);
  Write(dir, "valid_bf16", bf16.SerializeAsString());
  Write(dir, "valid_f16",
        server::BuildManifest(*Store(tiny, "c=f16,overflow=saturate", 0, 3), nullptr)
            .SerializeAsString());
  Write(dir, "valid_f32",
        server::BuildManifest(*Store("llama:layers=1,hidden=4,ffn=4,vocab=2", "f32", 0, 1), nullptr)
            .SerializeAsString());

  auto broken = [&](const char* name, auto&& edit) {
    layercast::v1::Manifest m = bf16;
    edit(m);
    Write(dir, name, m.SerializeAsString());
  };
  broken("invalid_digest", [](auto& m) { m.mutable_layout_digest()->back() ^= 1; });
  broken("invalid_offset",
         [](auto& m) { m.mutable_layers(1)->mutable_tensors(1)->set_byte_offset(8); });
  broken("invalid_shape", [](auto& m) { m.mutable_layers(1)->mutable_tensors(0)->add_shape(-1); });
  broken("invalid_dtype", [](auto& m) {
    m.mutable_layers(0)->mutable_tensors(0)->set_compute_dtype(layercast::v1::FLOAT16);
  });
  broken("invalid_index", [](auto& m) { m.mutable_layers(2)->set_index(7); });
  broken("invalid_shard", [](auto& m) { m.set_shard_index(2); });
  broken("invalid_policy", [](auto& m) { m.set_policy("c=bf8"); });
  broken("invalid_size", [](auto& m) { m.mutable_layers(1)->set_assembled_bytes(1); });
  // 2^50 bf16 elements: past kMaxAssembledLayerBytes on its own (the fuzzer's
  // repaired copy makes every other figure agree with it).
  broken("invalid_layer_cap", [](auto& m) {
    layercast::v1::Tensor* tensor = m.mutable_layers(1)->mutable_tensors(0);
    tensor->clear_shape();
    tensor->add_shape(int64_t{1} << 20);
    tensor->add_shape(int64_t{1} << 30);
    tensor->set_num_elements(uint64_t{1} << 50);
  });
}

void FetchPlanSeeds(const fs::path& dir) {
  auto request = [&](const char* name, uint32_t layer, uint64_t begin, uint64_t end, int dtype,
                     uint64_t min_version = 0) {
    layercast::v1::FetchLayerRequest r;
    r.set_layer(layer);
    r.set_range_begin(begin);
    r.set_range_end(end);
    r.set_expect_dtype(static_cast<layercast::v1::DType>(dtype));
    r.set_min_version(min_version);
    Write(dir, name, r.SerializeAsString());
  };
  request("valid_whole_layer", 1, 0, 0, 0);
  request("valid_range", 1, 256, 512, 0);
  request("valid_first_bytes", 2, 0, 8, 0);
  request("valid_expect_bf16", 0, 0, 0, layercast::v1::BFLOAT16);
  request("valid_expect_f32", 1, 0, 0, layercast::v1::FLOAT32);
  request("valid_min_version", 2, 0, 0, 0, 3);
  request("invalid_layer", 93, 0, 0, 0);
  request("invalid_half_range", 1, 256, 0, 0);
  request("invalid_reversed", 1, 512, 256, 0);
  request("invalid_split_element", 1, 0, 257, 0);
  request("invalid_beyond", 1, 0, 1ull << 40, 0);
  request("invalid_dtype", 1, 0, 0, 77);
  // Pulls that name their dtype (FetchLayerRequest.dtype): the master, an
  // fp8 fleet's (blocks may straddle shards: refused), and a delta in one.
  const auto pull_in = [&](const char* name, int dtype, std::optional<uint64_t> base) {
    layercast::v1::FetchLayerRequest r;
    r.set_layer(1);
    r.set_dtype(static_cast<layercast::v1::DType>(dtype));
    if (base) r.set_base_version(*base);
    Write(dir, name, r.SerializeAsString());
  };
  pull_in("valid_dtype_f32", layercast::v1::FLOAT32, std::nullopt);
  pull_in("dtype_e4m3", layercast::v1::FLOAT8_E4M3FN, std::nullopt);
  pull_in("invalid_delta_in_dtype", layercast::v1::FLOAT16, 0);
}

// Inputs of chunk_decoder_fuzzer (see there): a plan, then frames made by
// the server's own encoder.
void ChunkDecoderSeeds(const fs::path& dir) {
  // Frame `tensor` from `element` with `bytes` of data, the last
  // `scale_bytes` of them an 8-bit float chunk's block scales.
  const auto frame = [](uint32_t tensor, uint64_t element, size_t bytes, bool good_crc,
                        size_t scale_bytes = 0) {
    std::string data(bytes, '\0');
    for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(i * 7 + tensor);
    const grpc::Slice slice(data);
    const uint32_t crc =
        Crc32c(reinterpret_cast<const uint8_t*>(data.data()), bytes) ^ (good_crc ? 0u : 1u);
    grpc::ByteBuffer encoded = wire::EncodeLayerChunk(tensor, element, 3, crc, slice, scale_bytes);
    std::vector<grpc::Slice> slices;
    (void)encoded.Dump(&slices);
    std::string out;
    for (const grpc::Slice& s : slices)
      out.append(reinterpret_cast<const char*>(s.begin()), s.size());
    std::string framed = {static_cast<char>(out.size() & 0xff), static_cast<char>(out.size() >> 8)};
    return framed + out;
  };
  // Plan: two runs, bf16 elements 4..20 of tensor 0, f32 elements 0..9 of tensor 1.
  const std::string plan = {1, 1, 4, 15, 2, 0, 9};
  Write(dir, "valid_two_runs",
        plan + frame(0, 4, 16, true) + frame(0, 12, 16, true) + frame(1, 0, 40, true));
  Write(dir, "invalid_crc", plan + frame(0, 4, 16, false) + frame(0, 12, 16, true));
  Write(dir, "invalid_out_of_order", plan + frame(0, 12, 16, true) + frame(0, 4, 16, true));
  Write(dir, "invalid_too_long", plan + frame(0, 4, 64, true));
  Write(dir, "invalid_after_done",
        plan + frame(0, 4, 32, true) + frame(1, 0, 40, true) + frame(1, 10, 4, true));
  Write(dir, "invalid_garbage", plan + std::string("\x05\x00\xff\xff\xff\xff\xff", 7));
  // Plan: one 8-bit float run, elements 8..40 of tensor 0 in blocks of 16:
  // 32 codes and the scales of blocks 0-2.
  const std::string fp8_plan = {0, 3, 8, 31};
  Write(dir, "valid_fp8", fp8_plan + frame(0, 8, 32 + 12, true, 12));
  Write(dir, "invalid_fp8_scales", fp8_plan + frame(0, 8, 32 + 8, true, 8));
}

// Inputs of gradient_decoder_fuzzer (see there): a layout, then chunks cut
// by the worker's own chunker.
void GradientDecoderSeeds(const fs::path& dir) {
  // 2 shards, this is shard 1; bf16 x 300, f32 x 17, f16 x 40.
  const std::string header = {static_cast<char>(1 | 1 << 2), 1, 1, 44, 0, 0, 17, 2, 0, 40};
  const auto layout = *AssembledLayout::FromDTypes(
      {DType::kBFloat16, DType::kFloat32, DType::kFloat16}, {300, 17, 40});
  std::vector<uint8_t> gradient(layout.total_bytes());
  for (size_t i = 0; i < gradient.size(); ++i) gradient[i] = static_cast<uint8_t>(i * 13 % 251);
  wire::GradientChunker chunker(layout, gradient, {4, 0, 2, 1, 2}, 96);
  std::vector<std::string> frames;
  layercast::v1::GradientChunk chunk;
  while (chunker.Next(&chunk)) {
    const std::string bytes = chunk.SerializeAsString();
    frames.push_back(
        std::string{static_cast<char>(bytes.size() & 0xff), static_cast<char>(bytes.size() >> 8)} +
        bytes);
  }
  std::string all = header;
  for (const std::string& frame : frames) all += frame;
  Write(dir, "valid_whole_part", all);
  Write(dir, "invalid_out_of_order", header + frames[1] + frames[0]);
  Write(dir, "invalid_repeat", header + frames[0] + frames[0]);
  std::string corrupt = frames[0];
  corrupt[corrupt.size() / 2] ^= 0x40;
  Write(dir, "invalid_corrupt", header + corrupt);
}

// Inputs of publish_stage_fuzzer (see there): the whole publish of the
// fixture shard, as its publisher would send it, and broken variants.
void PublishStageSeeds(const fs::path& dir) {
  server::ParameterStore& store = PublishStageFixture();
  std::vector<std::string> frames;
  for (uint32_t l = 0; l < store.model().layers.size(); ++l) {
    for (uint32_t t = 0; t < store.model().layers[l].tensors.size(); ++t) {
      const ElementRange owned = store.owned(l, t);
      std::vector<float> values(owned.size());
      for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i % 7);
      layercast::v1::PublishChunk chunk;
      chunk.set_publish_id("p");
      chunk.set_layer(l);
      chunk.set_tensor(t);
      chunk.set_element_offset(owned.begin);
      chunk.set_dtype(layercast::v1::FLOAT32);
      chunk.set_data(values.data(), values.size() * sizeof(float));
      chunk.set_crc32c(Crc32c(chunk.data().data(), chunk.data().size()));
      const std::string bytes = chunk.SerializeAsString();
      frames.push_back(std::string{static_cast<char>(bytes.size() & 0xff),
                                   static_cast<char>(bytes.size() >> 8)} +
                       bytes);
    }
  }
  std::string all;
  for (const std::string& frame : frames) all += frame;
  Write(dir, "valid_whole", std::string(1, '\0') + all);
  Write(dir, "valid_right_id", std::string(1, '\1') + all);
  Write(dir, "invalid_missing_last",
        std::string(1, '\0') + all.substr(0, all.size() - frames.back().size()));
  Write(dir, "invalid_layer_outside", std::string(1, '\2') + all);
  std::string corrupt = frames[0];
  corrupt[corrupt.size() - 8] ^= 0x40;
  Write(dir, "invalid_corrupt", std::string(1, '\0') + corrupt + all);
}

}  // namespace
}  // namespace layercast::fuzz

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR (e.g. tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  namespace fs = std::filesystem;
  const fs::path out = argv[1];
  const fs::path scratch = fs::temp_directory_path() / "layercast-fuzz-seeds";
  fs::create_directories(scratch);
  layercast::fuzz::SafetensorsSeeds(out / "safetensors", scratch);
  layercast::fuzz::PolicySeeds(out / "policy");
  layercast::fuzz::ManifestSeeds(out / "manifest");
  layercast::fuzz::FetchPlanSeeds(out / "fetch_plan");
  layercast::fuzz::ChunkDecoderSeeds(out / "chunk_decoder");
  layercast::fuzz::GradientDecoderSeeds(out / "gradient_decoder");
  layercast::fuzz::PublishStageSeeds(out / "publish_stage");
  fs::remove_all(scratch);
  return 0;
}
