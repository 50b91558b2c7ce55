// A pull that names its dtype (FetchLayerRequest.dtype), against real shard
// processes: `layercast export` writes the fp32 master of shards that serve
// bfloat16, bit for bit, as one safetensors file or as Hugging Face shards
// with an index; and shards serving bfloat16 serve an inference fleet fp8
// that is exactly what fp8 shards serve, with no second copy.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/model_export.h"
#include "core/safetensors.h"
#include "tests/integration/shard_fixture.h"
#include "tests/integration/test_model.h"

namespace layercast::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::SizeIs;

// Every tensor `path` holds, widened to fp32, against the model's master.
void ExpectTheMaster(const std::string& path, const TestModel& model) {
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_THAT((*reader)->tensors(), SizeIs(model.values.size()));
  for (const SafetensorsTensor& tensor : (*reader)->tensors()) {
    SCOPED_TRACE(tensor.name);
    EXPECT_EQ(tensor.dtype, DType::kFloat32);
    const std::vector<float>& want = model.values.at(tensor.name);
    std::vector<float> got(tensor.num_elements);
    ASSERT_TRUE((*reader)->ReadF32(tensor, {0, tensor.num_elements}, got).ok());
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  }
}

TEST(ExportTest, TheFp32MasterComesBackBitForBitInOneFileOrInShards) {
  const std::string dir = MakeTempDir("export");
  const TestModel model = WriteTestModel(dir + "/model.safetensors", 3, 11);
  RunningShards shards = StartShards(2, {"--model", model.path, "--policy", "p=f32,c=bf16"});
  ASSERT_NE(shards.set, nullptr);
  const std::string list = absl::StrJoin(shards.processes->addresses(), ",");
  std::string output;

  ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " export --shards ", list, " --out ", dir,
                                    "/one.safetensors"),
                       &output),
            0)
      << output;
  EXPECT_THAT(output, HasSubstr("at version 0 to:"));
  ExpectTheMaster(dir + "/one.safetensors", model);
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> one =
      SafetensorsReader::Open(dir + "/one.safetensors");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)->metadata().at("format"), "pt");
  EXPECT_EQ((*one)->metadata().at("layercast_version"), "0");

  // Split as save_pretrained splits: numbered files and an index naming
  // each tensor's file, which a reader of the index (ours) follows.
  ASSERT_EQ(RunCommand(absl::StrCat(CliBinary(), " export --shards ", list, " --out ", dir,
                                    "/split.safetensors --max-file-size 64KiB"),
                       &output),
            0)
      << output;
  std::ifstream index_file(dir + "/split.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(index_file);
  EXPECT_THAT(index["weight_map"], SizeIs(model.values.size()));
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file);
  ASSERT_GE(files.size(), 2u);
  const std::string of = absl::StrFormat("-of-%05d.safetensors", files.size());
  EXPECT_EQ(*files.begin(), "split-00001" + of);
  EXPECT_EQ(*files.rbegin(), absl::StrFormat("split-%05d", files.size()) + of);
  for (const std::string& file : files) EXPECT_TRUE(std::filesystem::exists(dir + "/" + file));
  ExpectTheMaster(dir + "/split.safetensors.index.json", model);
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_NE(entry.path().extension(), ".partial") << entry.path();
  }

  // In bfloat16: what the shards serve a worker.
  client::ExportOptions bf16;
  bf16.path = dir + "/bf16.safetensors";
  bf16.dtype = DType::kBFloat16;
  absl::StatusOr<client::ExportResult> exported = client::ExportModel(*shards.set, bf16);
  ASSERT_TRUE(exported.ok()) << exported.status();
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(bf16.path);
  ASSERT_TRUE(reader.ok());
  for (uint32_t l = 0; l < shards.set->model().layers.size(); ++l) {
    absl::StatusOr<client::Layer> layer = shards.set->Gather(l);
    ASSERT_TRUE(layer.ok()) << layer.status();
    for (size_t t = 0; t < layer->num_tensors(); ++t) {
      const client::Layer::TensorView view = layer->tensor(t);
      const SafetensorsTensor* tensor = (*reader)->Find(std::string(view.name));
      ASSERT_NE(tensor, nullptr) << view.name;
      EXPECT_EQ(tensor->dtype, DType::kBFloat16);
      std::ifstream file(bf16.path, std::ios::binary);
      std::vector<uint8_t> bytes(view.bytes.size());
      file.seekg(static_cast<std::streamoff>(tensor->data_begin));
      file.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
      EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), view.bytes.begin())) << view.name;
    }
  }

  // Refused, with what to do, before anything is written.
  EXPECT_EQ(
      RunCommand(absl::StrCat(CliBinary(), " export --shards ", list, " --out ", dir, "/model.bin"),
                 &output),
      2);
  EXPECT_THAT(output, HasSubstr("does not end in .safetensors"));
  EXPECT_EQ(RunCommand(absl::StrCat(CliBinary(), " export --shards ", list, " --out ", dir,
                                    "/fp8.safetensors --dtype f8e4m3"),
                       &output),
            2);
  EXPECT_THAT(output, HasSubstr("no agreed place for its block scales"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/fp8.safetensors"));
  EXPECT_EQ(shards.processes->Stop(), absl::OkStatus());
}

TEST(ExportTest, ShardsServingBf16ServeAFleetTheFp8ThatFp8ShardsServe) {
  constexpr char kModel[] = "llama:layers=2,hidden=64,ffn=96,vocab=50";
  RunningShards trainers =
      StartShards(2, {"--synthetic", kModel, "--policy", "p=f32,c=bf16,fp8_block=32"});
  RunningShards fp8 =
      StartShards(2, {"--synthetic", kModel, "--policy", "p=f32,c=f8e4m3,fp8_block=32"});
  ASSERT_NE(trainers.set, nullptr);
  ASSERT_NE(fp8.set, nullptr);
  for (uint32_t l = 0; l < trainers.set->model().layers.size(); ++l) {
    SCOPED_TRACE(absl::StrCat("layer ", l));
    const AssembledLayout& layout = fp8.set->view().layouts[l];
    std::vector<uint8_t> want(layout.total_bytes()), got(layout.total_bytes());
    ASSERT_TRUE(fp8.set->GatherInto(l, {}, want).ok());
    client::GatherOptions options;
    options.dtype = DType::kFloat8E4M3FN;
    // No delta in a dtype of its own: the whole layer comes instead.
    options.base_version = 0;
    absl::StatusOr<uint64_t> version = trainers.set->GatherInto(l, options, got);
    ASSERT_TRUE(version.ok()) << version.status();
    EXPECT_EQ(got, want);
  }
  // The trainers' own pulls are still bfloat16.
  absl::StatusOr<client::Layer> layer = trainers.set->Gather(1);
  ASSERT_TRUE(layer.ok());
  EXPECT_EQ(layer->tensor(0).dtype, DType::kBFloat16);
  EXPECT_EQ(trainers.processes->Stop(), absl::OkStatus());
  EXPECT_EQ(fp8.processes->Stop(), absl::OkStatus());
}

}  // namespace
}  // namespace layercast::testing
