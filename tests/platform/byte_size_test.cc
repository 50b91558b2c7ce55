#include "platform/byte_size.h"

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

// The spellings a Kubernetes manifest uses for memory, next to which the
// budget is written.
TEST(ByteSizeTest, ParsesKubernetesQuantities) {
  EXPECT_EQ(*ParseByteSize("4Gi"), 4ull << 30);
  EXPECT_EQ(*ParseByteSize("4608Mi"), 4608ull << 20);
  EXPECT_EQ(*ParseByteSize("512Ki"), 512u << 10);
  EXPECT_EQ(*ParseByteSize("1Ti"), 1ull << 40);
  EXPECT_EQ(*ParseByteSize("500M"), 500'000'000u);
  EXPECT_EQ(*ParseByteSize("2G"), 2'000'000'000u);
  EXPECT_EQ(*ParseByteSize("3k"), 3000u);
  EXPECT_EQ(*ParseByteSize("1T"), 1'000'000'000'000ull);
  // Kubernetes has no "K" (kilo is "k") and no "m" for memory here.
  for (const char* text : {"4K", "4Gib", "4gi", "100m"}) {
    EXPECT_EQ(ParseByteSize(text).status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
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
