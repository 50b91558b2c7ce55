#include "core/safetensors_split.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace layercast {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Header = SafetensorsWriter::TensorHeader;

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

}  // namespace
}  // namespace layercast
