#include "core/byte_size.h"

#include <gtest/gtest.h>

namespace layercast {
namespace {

TEST(ByteSizeTest, ParsesSuffixes) {
  EXPECT_EQ(*ParseByteSize("0"), 0u);
  EXPECT_EQ(*ParseByteSize("512"), 512u);
  EXPECT_EQ(*ParseByteSize("512B"), 512u);
  EXPECT_EQ(*ParseByteSize("8KiB"), 8192u);
  EXPECT_EQ(*ParseByteSize("16GiB"), 16ull << 30);
  EXPECT_EQ(*ParseByteSize("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*ParseByteSize("2TB"), 2'000'000'000'000ull);
  EXPECT_EQ(*ParseByteSize("3MB"), 3'000'000u);
}

TEST(ByteSizeTest, RefusesGarbage) {
  for (const char* text : {"", "GiB", "-1GiB", "12 GiB", "1e3", "12XB", "0x10", "nan"}) {
    absl::StatusOr<uint64_t> size = ParseByteSize(text);
    EXPECT_EQ(size.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
  EXPECT_EQ(ParseByteSize("99999999TiB").status().code(), absl::StatusCode::kOutOfRange);
}

TEST(ByteSizeTest, FormatsForPeople) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(17.5 * (1ull << 30)), "17.50 GiB");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
}

}  // namespace
}  // namespace layercast
