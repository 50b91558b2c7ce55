#include "core/safetensors_split.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace layercast {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Header = SafetensorsWriter::TensorHeader;

// A fresh directory per test, so tests never see each other's files.
std::string MakeTestDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("layercast_split_" + std::to_string(getpid())) /
                                    (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// Places "a" and "b" (two F32 each, every element `value`) at `path`, in
// files of at most `max_file_bytes`.
absl::StatusOr<std::vector<std::string>> Place(const std::string& path, uint64_t max_file_bytes,
                                               float value) {
  const std::vector<Header> tensors = {{"a", DType::kFloat32, {2}}, {"b", DType::kFloat32, {2}}};
  const absl::StatusOr<SafetensorsSplit> split =
      PlanSafetensorsSplit(tensors, max_file_bytes, path);
  if (!split.ok()) return split.status();
  return PlaceSafetensorsSplit(*split, [&](const std::vector<std::string>& partials) {
    for (size_t f = 0; f < partials.size(); ++f) {
      absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
          SafetensorsWriter::Create(partials[f], split->files[f], {});
      if (!writer.ok()) return writer.status();
      for (size_t t = 0; t < split->files[f].size(); ++t) {
        const float values[2] = {value, value};
        const absl::Status appended =
            (*writer)->Append({reinterpret_cast<const uint8_t*>(values), sizeof(values)});
        if (!appended.ok()) return appended;
      }
      const absl::Status finished = (*writer)->Finish();
      if (!finished.ok()) return finished;
    }
    return absl::OkStatus();
  });
}

// Every element of "a" and "b" as the shards' reader reads `path`.
std::vector<float> Read(const std::string& path) {
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  EXPECT_TRUE(reader.ok()) << reader.status();
  if (!reader.ok()) return {};
  std::vector<float> values(4);
  for (const char* name : {"a", "b"}) {
    const SafetensorsTensor* tensor = (*reader)->Find(name);
    EXPECT_NE(tensor, nullptr) << name;
    if (tensor == nullptr) return {};
    EXPECT_TRUE(
        (*reader)
            ->ReadF32(*tensor, {0, 2}, std::span<float>(values).subspan(name[0] == 'a' ? 0 : 2, 2))
            .ok());
  }
  return values;
}

TEST(SafetensorsSplitTest, ANewFileWhenTheNextTensorWouldPassTheLimit) {
  // 8 + 4 bytes fit 16; 24 bytes go alone although over it; 8 bytes of I64
  // would take that file past it.
  const std::vector<Header> tensors = {{"a", DType::kFloat32, {2}},
                                       {"b", DType::kFloat32, {1}},
                                       {"c", DType::kFloat32, {2, 3}},
                                       {"d", IntegerDType::kInt64, {}}};
  const absl::StatusOr<SafetensorsSplit> split =
      PlanSafetensorsSplit(tensors, 16, "out/opt.safetensors");
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_THAT(split->file_of, ElementsAre(0, 0, 1, 2));
  EXPECT_THAT(split->paths, ElementsAre("out/opt-00001-of-00003.safetensors",
                                        "out/opt-00002-of-00003.safetensors",
                                        "out/opt-00003-of-00003.safetensors"));
  EXPECT_EQ(split->bytes, 44u);
  EXPECT_EQ(SafetensorsIndexJson(*split),
            "{\n  \"metadata\": {\n    \"total_size\": 44\n  },\n  \"weight_map\": {\n"
            "    \"a\": \"opt-00001-of-00003.safetensors\",\n"
            "    \"b\": \"opt-00001-of-00003.safetensors\",\n"
            "    \"c\": \"opt-00002-of-00003.safetensors\",\n"
            "    \"d\": \"opt-00003-of-00003.safetensors\"\n  }\n}\n");

  // At the limit, one file under the path itself.
  const absl::StatusOr<SafetensorsSplit> whole =
      PlanSafetensorsSplit(tensors, 44, "out/opt.safetensors");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_FALSE(whole->split());
  EXPECT_THAT(whole->paths, ElementsAre("out/opt.safetensors"));
}

TEST(SafetensorsSplitTest, RefusesWhatNoSplitCanName) {
  const std::vector<Header> one = {{"a", DType::kFloat32, {2}}};
  EXPECT_THAT(PlanSafetensorsSplit(one, 16, "opt.bin").status().message(),
              HasSubstr("does not end in .safetensors"));
  EXPECT_THAT(PlanSafetensorsSplit(one, 16, ".safetensors").status().message(),
              HasSubstr("does not end in .safetensors"));
  const std::vector<Header> twice = {{"a", DType::kFloat32, {2}}, {"a", DType::kFloat32, {1}}};
  EXPECT_THAT(PlanSafetensorsSplit(twice, 4, "m.safetensors").status().message(),
              HasSubstr("'a' for 'm.safetensors' is given twice"));
  const std::vector<Header> huge = {{"h", DType::kFloat32, {INT64_MAX, 4}}};
  EXPECT_THAT(PlanSafetensorsSplit(huge, 16, "m.safetensors").status().message(),
              HasSubstr("does not fit in 64 bits"));
}

TEST(SafetensorsSplitTest, PlacingOneFormRemovesTheOtherAtThePath) {
  const std::string dir = MakeTestDir();
  const std::string path = dir + "/m.safetensors";
  const std::string index = SafetensorsIndexPath(path);
  EXPECT_EQ(index, dir + "/m.safetensors.index.json");
  const std::string first = dir + "/m-00001-of-00002.safetensors";
  const std::string second = dir + "/m-00002-of-00002.safetensors";

  ASSERT_TRUE(Place(path, 16, 1.0f).ok());
  // Split at the same path: a loader finding the single file would read it
  // instead of the split.
  const absl::StatusOr<std::vector<std::string>> split = Place(path, 8, 2.0f);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_THAT(*split, ElementsAre(first, second, index));
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_THAT(Read(index), ElementsAre(2, 2, 2, 2));

  // One file again: the index and every file it named go.
  const absl::StatusOr<std::vector<std::string>> whole = Place(path, 16, 3.0f);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_THAT(*whole, ElementsAre(path));
  for (const std::string& gone : {index, first, second}) {
    EXPECT_FALSE(std::filesystem::exists(gone)) << gone;
  }
  EXPECT_THAT(Read(path), ElementsAre(3, 3, 3, 3));
}

TEST(SafetensorsSplitTest, AFailedWriteLeavesOnlyTheEarlierModel) {
  const std::string dir = MakeTestDir();
  const std::string path = dir + "/m.safetensors";
  ASSERT_TRUE(Place(path, 16, 1.0f).ok());
  const std::vector<Header> tensors = {{"a", DType::kFloat32, {2}}, {"b", DType::kFloat32, {2}}};
  const absl::StatusOr<SafetensorsSplit> split = PlanSafetensorsSplit(tensors, 8, path);
  ASSERT_TRUE(split.ok()) << split.status();
  const absl::StatusOr<std::vector<std::string>> placed =
      PlaceSafetensorsSplit(*split, [&](const std::vector<std::string>& partials) {
        // Half a model: the first file, then the second fails.
        std::ofstream(partials[0]) << "partly";
        return absl::UnavailableError("the disk went away");
      });
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kUnavailable);
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    left.push_back(entry.path().filename().string());
  }
  EXPECT_THAT(left, ElementsAre("m.safetensors"));
  EXPECT_THAT(Read(path), ElementsAre(1, 1, 1, 1));
}

}  // namespace
}  // namespace layercast
