#include "core/safetensors.h"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace layercast {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A fresh directory per test, so tests never see each other's files.
std::string MakeTestDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("layercast_safetensors_" + std::to_string(getpid())) /
                                    (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string LengthPrefix(uint64_t n) {
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>(n >> (8 * i));
  return prefix;
}

// A safetensors file written by hand: length prefix, `header` verbatim, data.
std::string HandMade(const std::string& header, const std::string& data) {
  return LengthPrefix(header.size()) + header + data;
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

template <typename T>
std::span<const uint8_t> ByteSpan(const std::vector<T>& values) {
  return {reinterpret_cast<const uint8_t*>(values.data()), values.size() * sizeof(T)};
}

// Opens a hand-made file and expects INVALID_ARGUMENT naming the file and
// containing `problem`.
void ExpectRejected(const std::string& header, const std::string& data,
                    const std::string& problem) {
  const std::string path = MakeTestDir() + "/bad.safetensors";
  WriteBytes(path, HandMade(header, data));
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_FALSE(reader.ok()) << header;
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument) << reader.status();
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr(problem));
}

// Wraps the real file system and counts the bytes every ReadAt asks for, to
// prove which bytes a read touches.
class CountingFileSystem : public FileSystem {
 public:
  uint64_t bytes_read() const { return bytes_read_; }
  void Reset() { bytes_read_ = 0; }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> file = DefaultFileSystem().OpenForRead(path);
    if (!file.ok()) return file.status();
    return std::make_unique<CountingFile>(*std::move(file), &bytes_read_);
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForWrite(const std::string& path) override {
    return DefaultFileSystem().OpenForWrite(path);
  }
  absl::StatusOr<std::unique_ptr<WritableFile>> CreatePrivate(const std::string& path) override {
    return DefaultFileSystem().CreatePrivate(path);
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    return DefaultFileSystem().Rename(from, to);
  }
  absl::Status SyncDir(const std::string& dir) override { return DefaultFileSystem().SyncDir(dir); }
  absl::Status Remove(const std::string& path) override { return DefaultFileSystem().Remove(path); }
  bool Exists(const std::string& path) override { return DefaultFileSystem().Exists(path); }

 private:
  class CountingFile : public RandomAccessFile {
   public:
    CountingFile(std::unique_ptr<RandomAccessFile> inner, std::atomic<uint64_t>* counter)
        : inner_(std::move(inner)), counter_(counter) {}
    uint64_t size() const override { return inner_->size(); }
    const std::string& path() const override { return inner_->path(); }
    FilePermissions permissions() const override { return inner_->permissions(); }
    absl::Status ReadAt(uint64_t offset, std::span<uint8_t> out) const override {
      *counter_ += out.size();
      return inner_->ReadAt(offset, out);
    }

   private:
    std::unique_ptr<RandomAccessFile> inner_;
    std::atomic<uint64_t>* counter_;
  };

  std::atomic<uint64_t> bytes_read_{0};
};

// A file that claims to be 1 TiB and whose first 8 bytes declare a header just
// above the limit; any other read fails the test. Shows the limit is enforced
// before anything is read or allocated.
class HugeHeaderFileSystem : public CountingFileSystem {
 public:
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    return std::make_unique<HugeFile>(path);
  }

 private:
  class HugeFile : public RandomAccessFile {
   public:
    explicit HugeFile(std::string path) : path_(std::move(path)) {}
    uint64_t size() const override { return uint64_t{1} << 40; }
    const std::string& path() const override { return path_; }
    FilePermissions permissions() const override { return {.mode = 0644, .owner_uid = 0}; }
    absl::Status ReadAt(uint64_t offset, std::span<uint8_t> out) const override {
      EXPECT_EQ(offset, 0u);
      EXPECT_EQ(out.size(), 8u);
      const std::string prefix = LengthPrefix(kMaxSafetensorsHeaderBytes + 1);
      std::memcpy(out.data(), prefix.data(), std::min<size_t>(out.size(), 8));
      return absl::OkStatus();
    }

   private:
    std::string path_;
  };
};

constexpr char kOneF32Tensor[] = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

TEST(SafetensorsReaderTest, OpensHandMadeFile) {
  const std::string path = MakeTestDir() + "/ok.safetensors";
  WriteBytes(path, HandMade(kOneF32Tensor, Bytes(std::vector<float>{1.5f, -3.0f})));
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const SafetensorsTensor* t = (*reader)->Find("t");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->num_elements, 2u);
  EXPECT_EQ(t->data_begin, 8 + std::strlen(kOneF32Tensor));
  std::vector<float> values(2);
  ASSERT_TRUE((*reader)->ReadF32(*t, {0, 2}, values).ok());
  EXPECT_THAT(values, ElementsAre(1.5f, -3.0f));
  EXPECT_EQ((*reader)->Find("missing"), nullptr);
}

TEST(SafetensorsReaderTest, MissingFileIsNotFound) {
  const std::string path = MakeTestDir() + "/absent.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr(path));
}

TEST(SafetensorsReaderTest, RejectsFileShorterThanLengthPrefix) {
  const std::string path = MakeTestDir() + "/short.safetensors";
  WriteBytes(path, std::string("\x05\x00\x00", 3));
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr("3 bytes long"));
}

TEST(SafetensorsReaderTest, RejectsHeaderLengthBeyondFile) {
  const std::string path = MakeTestDir() + "/truncated.safetensors";
  WriteBytes(path, LengthPrefix(1000) + "{}");
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(reader.status().message()),
              HasSubstr("1000-byte header but only 2 bytes follow"));
}

TEST(SafetensorsReaderTest, RejectsHeaderAboveLimitBeforeReadingIt) {
  HugeHeaderFileSystem fs;
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader =
      SafetensorsReader::Open("huge.safetensors", fs);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr("huge.safetensors"));
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr("above the limit"));
}

TEST(SafetensorsReaderTest, RejectsHeaderThatIsNotJson) {
  ExpectRejected("{\"t\": garbage", "", "not valid JSON");
}

TEST(SafetensorsReaderTest, RejectsHeaderThatIsNotAnObject) {
  ExpectRejected("[1, 2, 3]", "", "is a JSON array, not an object");
}

TEST(SafetensorsReaderTest, RejectsFieldsOfWrongType) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"t": 7})", "not an object"},
      {R"({"t":{"dtype":32,"shape":[2],"data_offsets":[0,8]}})", "\"dtype\" must be a string"},
      {R"({"t":{"shape":[2],"data_offsets":[0,8]}})", "\"dtype\" must be a string"},
      {R"({"t":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", "\"shape\" must be an array"},
      {R"({"t":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", "not a non-negative integer"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", "\"data_offsets\" must be"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}})", "\"data_offsets\" must be"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", "\"data_offsets\" must be"},
      {R"({"__metadata__":{"format":1}})", "'format' is a JSON number, not a string"},
  };
  for (const auto& [header, problem] : cases) {
    SCOPED_TRACE(header);
    ExpectRejected(header, std::string(8, '\0'), problem);
  }
}

TEST(SafetensorsReaderTest, RejectsFloatingDtypesItCannotServe) {
  for (const char* dtype : {"F64", "F8_E4M3", "Q4"}) {
    ExpectRejected(
        absl::StrCat(R"({"t":{"dtype":")", dtype, R"(","shape":[1],"data_offsets":[0,8]}})"),
        std::string(8, '\0'), absl::StrCat("dtype '", dtype, "' is not supported"));
  }
}

// Integer and boolean tensors (position ids in I32, a BOOL mask) are checked
// like the others, then left out of tensors() and listed in skipped(); their
// bytes still may not overlap another tensor's.
TEST(SafetensorsReaderTest, SkipsTensorsOfDtypesItDoesNotServe) {
  const std::string path = MakeTestDir() + "/mixed.safetensors";
  WriteBytes(path, HandMade(R"({"ids":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
                            R"("w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
                            R"("x":{"dtype":"BOOL","shape":[8],"data_offsets":[16,24]}})",
                            std::string(24, '\0')));
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_EQ((*reader)->tensors().size(), 1u);
  EXPECT_EQ((*reader)->tensors()[0].name, "w");
  ASSERT_EQ((*reader)->skipped().size(), 2u);
  EXPECT_EQ((*reader)->skipped()[0].name, "ids");
  EXPECT_EQ((*reader)->skipped()[0].dtype, "I32");
  EXPECT_EQ((*reader)->skipped()[0].shape, std::vector<int64_t>{2});
  EXPECT_EQ((*reader)->skipped()[1].dtype, "BOOL");

  ExpectRejected(R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
                 R"("w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                 std::string(16, '\0'), "overlap");
  ExpectRejected(R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,8]}})",
                 std::string(8, '\0'), "of I64 needs 16 bytes");
}

TEST(SafetensorsReaderTest, RejectsNegativeDimension) {
  ExpectRejected(R"({"t":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,8]}})",
                 std::string(8, '\0'), "dimension -1 is negative");
}

TEST(SafetensorsReaderTest, RejectsElementCountOverflow) {
  // 2^32 * 2^32 elements wraps to 0, which would match the empty span.
  ExpectRejected(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})",
                 "", "more elements than fit in 64 bits");
}

TEST(SafetensorsReaderTest, RejectsByteSizeOverflow) {
  // 2^62 elements fit; 2^64 bytes of F32 do not (and wrap to 0).
  ExpectRejected(R"({"t":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", "",
                 "more bytes than fit in 64 bits");
}

TEST(SafetensorsReaderTest, RejectsShapeThatDisagreesWithOffsets) {
  ExpectRejected(R"({"t":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0'),
                 "needs 6 bytes but data_offsets [0, 8] span 8");
}

TEST(SafetensorsReaderTest, RejectsBeginAfterEnd) {
  ExpectRejected(R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", std::string(8, '\0'),
                 "begin after they end");
}

TEST(SafetensorsReaderTest, RejectsOffsetsBeyondData) {
  ExpectRejected(R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", std::string(8, '\0'),
                 "reach beyond the 8 data bytes");
}

TEST(SafetensorsReaderTest, RejectsOverlappingTensors) {
  ExpectRejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                 std::string(12, '\0'), "tensors 'a' and 'b' overlap");
}

TEST(SafetensorsReaderTest, RejectsDuplicateNameInHeader) {
  ExpectRejected(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                 R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                 std::string(8, '\0'), "names 'a' more than once");
}

TEST(SafetensorsReaderTest, AcceptsScalarsAndEmptyTensors) {
  const std::string path = MakeTestDir() + "/edge.safetensors";
  WriteBytes(path, HandMade(R"({"empty":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]},)"
                            R"("scalar":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})",
                            Bytes(std::vector<float>{7.0f})));
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->Find("empty")->num_elements, 0u);
  EXPECT_EQ((*reader)->Find("scalar")->num_elements, 1u);
}

// Every prefix of a valid file, and the file with any one header byte
// replaced, must open cleanly or fail with INVALID_ARGUMENT, never crash.
TEST(SafetensorsReaderTest, SurvivesTruncationAndCorruption) {
  const std::string valid =
      HandMade(R"({"__metadata__":{"k":"v"},"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},)"
               R"("b":{"dtype":"F32","shape":[1,1],"data_offsets":[4,8]}})",
               std::string(8, '\x01'));
  const std::string path = MakeTestDir() + "/mutant.safetensors";
  const size_t header_end = valid.size() - 8;
  auto check = [&](const std::string& bytes) {
    WriteBytes(path, bytes);
    absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
    if (!reader.ok()) {
      EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument) << reader.status();
      return;
    }
    for (const SafetensorsTensor& t : (*reader)->tensors()) {
      std::vector<float> out(t.num_elements);
      EXPECT_TRUE((*reader)->ReadF32(t, {0, t.num_elements}, out).ok());
    }
  };
  for (size_t length = 0; length < valid.size(); ++length) check(valid.substr(0, length));
  for (size_t i = 0; i < header_end; ++i) {
    for (char replacement : {'\0', '\xff', '9', '"', '}', '-'}) {
      std::string mutant = valid;
      mutant[i] = replacement;
      check(mutant);
    }
  }
}

TEST(SafetensorsReaderTest, ReadF32RejectsBadRanges) {
  const std::string path = MakeTestDir() + "/ok.safetensors";
  WriteBytes(path, HandMade(kOneF32Tensor, Bytes(std::vector<float>{1.0f, 2.0f})));
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const SafetensorsTensor& t = *(*reader)->Find("t");
  std::vector<float> three(3);
  EXPECT_EQ((*reader)->ReadF32(t, {0, 3}, three).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*reader)->ReadF32(t, {2, 1}, {}).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*reader)->ReadF32(t, {0, 2}, three).code(), absl::StatusCode::kInvalidArgument);
}

// Writes `tensors` (name, dtype, shape, raw bytes) with SafetensorsWriter.
struct RawTensor {
  std::string name;
  SafetensorsDType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::string bytes;
};

void WriteModel(const std::string& path, const std::vector<RawTensor>& tensors,
                const std::map<std::string, std::string>& metadata = {}) {
  std::vector<SafetensorsWriter::TensorHeader> headers;
  for (const RawTensor& t : tensors) headers.push_back({t.name, t.dtype, t.shape});
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, headers, metadata);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (const RawTensor& t : tensors) {
    ASSERT_TRUE(
        (*writer)->Append({reinterpret_cast<const uint8_t*>(t.bytes.data()), t.bytes.size()}).ok());
  }
  ASSERT_TRUE((*writer)->Finish().ok());
}

// 1.0, -2.5, 0.5 and 0 spelled by hand, so the test does not trust the cast
// kernels to produce its inputs.
const std::vector<uint16_t> kBf16Bits = {0x3F80, 0xC020, 0x3F00, 0x0000};
const std::vector<uint16_t> kF16Bits = {0x3C00, 0xC100, 0x3800, 0x0000};
const std::vector<float> kValues = {1.0f, -2.5f, 0.5f, 0.0f};

TEST(SafetensorsRoundTripTest, AllDtypesAndMetadata) {
  const std::string path = MakeTestDir() + "/model.safetensors";
  WriteModel(path,
             {{"w32", DType::kFloat32, {2, 2}, Bytes(kValues)},
              {"wbf16", DType::kBFloat16, {4}, Bytes(kBf16Bits)},
              {"wf16", DType::kFloat16, {1, 4}, Bytes(kF16Bits)}},
             {{"format", "pt"}});
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ((*reader)->tensors().size(), 3u);
  for (const char* name : {"w32", "wbf16", "wf16"}) {
    SCOPED_TRACE(name);
    const SafetensorsTensor* t = (*reader)->Find(name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->num_elements, 4u);
    std::vector<float> values(4);
    ASSERT_TRUE((*reader)->ReadF32(*t, {0, 4}, values).ok());
    EXPECT_EQ(values, kValues);
  }
  EXPECT_EQ((*reader)->Find("w32")->shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ((*reader)->Find("wbf16")->dtype, DType::kBFloat16);
  EXPECT_EQ((*reader)->Find("wf16")->dtype, DType::kFloat16);
}

TEST(SafetensorsRoundTripTest, HeaderIsSpacePaddedToEightBytesAndDense) {
  const std::string path = MakeTestDir() + "/model.safetensors";
  WriteModel(path, {{"b", DType::kBFloat16, {3}, Bytes(std::vector<uint16_t>{1, 2, 3})},
                    {"a", DType::kFloat32, {1}, Bytes(std::vector<float>{1.0f})}});
  std::ifstream in(path, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GE(file.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[i]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(file.size(), 8 + n + 10);
  const std::string header = file.substr(8, n);
  EXPECT_EQ(header.find("__metadata__"), std::string::npos);  // omitted when empty
  EXPECT_THAT(header, HasSubstr(R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]})"));
  EXPECT_THAT(header, HasSubstr(R"("a":{"dtype":"F32","shape":[1],"data_offsets":[6,10]})"));
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}'));
}

// The integer and boolean dtypes the Python package writes (a
// state_dict()'s num_batches_tracked, torch's optimizer "step"): each with
// its tag and its element size, its bytes where the reader finds them.
TEST(SafetensorsRoundTripTest, IntegerAndBooleanDtypes) {
  const std::string path = MakeTestDir() + "/ints.safetensors";
  const std::vector<int64_t> steps = {4, -1};
  const std::vector<int32_t> ids = {7, 8, 9};
  const std::vector<uint8_t> mask = {1, 0, 1};
  const std::vector<uint16_t> u16 = {65535};
  WriteModel(path, {{"steps", IntegerDType::kInt64, {2}, Bytes(steps)},
                    {"w", DType::kFloat32, {4}, Bytes(kValues)},
                    {"ids", IntegerDType::kInt32, {1, 3}, Bytes(ids)},
                    {"mask", IntegerDType::kBool, {3}, Bytes(mask)},
                    {"u16", IntegerDType::kUInt16, {}, Bytes(u16)},
                    {"none", IntegerDType::kInt64, {0, 5}, ""}});
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  ASSERT_EQ((*reader)->tensors().size(), 1u);
  std::ifstream in(path, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, SafetensorsSkipped> skipped;
  for (const SafetensorsSkipped& tensor : (*reader)->skipped()) skipped[tensor.name] = tensor;
  ASSERT_EQ(skipped.size(), 5u);
  EXPECT_EQ(skipped["steps"].dtype, "I64");
  EXPECT_EQ(skipped["ids"].dtype, "I32");
  EXPECT_EQ(skipped["ids"].shape, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(skipped["mask"].dtype, "BOOL");
  EXPECT_EQ(skipped["u16"].dtype, "U16");
  EXPECT_EQ(skipped["u16"].shape, std::vector<int64_t>{});
  EXPECT_EQ(skipped["none"].bytes, 0u);
  EXPECT_EQ(file.substr(skipped["steps"].data_begin, skipped["steps"].bytes), Bytes(steps));
  EXPECT_EQ(file.substr(skipped["ids"].data_begin, skipped["ids"].bytes), Bytes(ids));
  EXPECT_EQ(file.substr(skipped["mask"].data_begin, skipped["mask"].bytes), Bytes(mask));
  EXPECT_EQ(file.substr(skipped["u16"].data_begin, skipped["u16"].bytes), Bytes(u16));
  // Dense in declared order: the float tensor sits right after the steps.
  EXPECT_EQ((*reader)->tensors()[0].data_begin, skipped["steps"].data_begin + 16);
}

// Every tag the writer writes parses back to its dtype with its size; the
// reader's refusals (F64) are the parser's too.
TEST(SafetensorsDTypeTest, TagsAndSizes) {
  const std::vector<std::pair<SafetensorsDType, size_t>> all = {
      {DType::kFloat32, 4},       {DType::kBFloat16, 2},     {DType::kFloat16, 2},
      {DType::kFloat8E4M3FN, 1},  {DType::kFloat8E5M2, 1},   {IntegerDType::kBool, 1},
      {IntegerDType::kUInt8, 1},  {IntegerDType::kInt8, 1},  {IntegerDType::kInt16, 2},
      {IntegerDType::kUInt16, 2}, {IntegerDType::kInt32, 4}, {IntegerDType::kUInt32, 4},
      {IntegerDType::kInt64, 8},  {IntegerDType::kUInt64, 8}};
  std::set<std::string> names;
  for (const auto& [dtype, size] : all) {
    SCOPED_TRACE(dtype.name());
    EXPECT_EQ(dtype.size(), size);
    EXPECT_TRUE(names.insert(std::string(dtype.name())).second) << "two dtypes share a tag";
    absl::StatusOr<SafetensorsDType> parsed = SafetensorsDType::FromName(dtype.name());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, dtype);
  }
  EXPECT_EQ(SafetensorsDType(IntegerDType::kInt64).name(), "I64");
  EXPECT_EQ(SafetensorsDType(IntegerDType::kBool).name(), "BOOL");
  EXPECT_FALSE(IntegerDTypeFromSafetensorsName("F32").has_value());
  for (const char* tag : {"F64", "i64", ""}) {
    absl::StatusOr<SafetensorsDType> refused = SafetensorsDType::FromName(tag);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << tag;
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("I64")) << tag;
  }
}

TEST(SafetensorsRoundTripTest, ReadsExactlyTheRequestedElements) {
  const std::string path = MakeTestDir() + "/model.safetensors";
  std::vector<float> f32(100);
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = static_cast<float>(i);
  // bf16 of small integers is the top half of the fp32 bits.
  std::vector<uint16_t> bf16(100);
  for (size_t i = 0; i < bf16.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &f32[i], 4);
    bf16[i] = static_cast<uint16_t>(bits >> 16);
  }
  WriteModel(path, {{"f", DType::kFloat32, {10, 10}, Bytes(f32)},
                    {"h", DType::kBFloat16, {100}, Bytes(bf16)}});
  CountingFileSystem fs;
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path, fs);
  ASSERT_TRUE(reader.ok()) << reader.status();

  fs.Reset();
  std::vector<float> out(7);
  ASSERT_TRUE((*reader)->ReadF32(*(*reader)->Find("f"), {31, 38}, out).ok());
  EXPECT_THAT(out, ElementsAre(31, 32, 33, 34, 35, 36, 37));
  EXPECT_EQ(fs.bytes_read(), 7 * 4u);

  fs.Reset();
  ASSERT_TRUE((*reader)->ReadF32(*(*reader)->Find("h"), {93, 100}, out).ok());
  EXPECT_THAT(out, ElementsAre(93, 94, 95, 96, 97, 98, 99));
  EXPECT_EQ(fs.bytes_read(), 7 * 2u);
}

TEST(SafetensorsRoundTripTest, WidensLargeSixteenBitRangesInChunks) {
  // 1.5 Mi elements of bf16 = 3 MiB: more than one widening chunk.
  const size_t n = 3 << 19;
  std::vector<uint16_t> bits(n);
  for (size_t i = 0; i < n; ++i) bits[i] = kBf16Bits[i % 3];
  const std::string path = MakeTestDir() + "/big.safetensors";
  WriteModel(path, {{"big", DType::kBFloat16, {static_cast<int64_t>(n)}, Bytes(bits)}});
  CountingFileSystem fs;
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path, fs);
  ASSERT_TRUE(reader.ok()) << reader.status();
  fs.Reset();
  std::vector<float> out(n - 5);
  ASSERT_TRUE((*reader)->ReadF32(*(*reader)->Find("big"), {5, n}, out).ok());
  EXPECT_EQ(fs.bytes_read(), (n - 5) * 2);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i], kValues[(i + 5) % 3]) << i;
  }
}

TEST(SafetensorsIndexTest, ReadsTwoFiles) {
  const std::string dir = MakeTestDir();
  WriteModel(dir + "/model-00001-of-00002.safetensors",
             {{"model.embed_tokens.weight", DType::kFloat32, {2}, Bytes(std::vector<float>{1, 2})}},
             {{"format", "pt"}});
  WriteModel(dir + "/model-00002-of-00002.safetensors",
             {{"lm_head.weight", DType::kBFloat16, {4}, Bytes(kBf16Bits)},
              {"model.norm.weight", DType::kFloat32, {1}, Bytes(std::vector<float>{3})}});
  WriteBytes(dir + "/model.safetensors.index.json",
             R"({"metadata": {"total_size": 20}, "weight_map": {)"
             R"("model.embed_tokens.weight": "model-00001-of-00002.safetensors",)"
             R"("lm_head.weight": "model-00002-of-00002.safetensors",)"
             R"("model.norm.weight": "model-00002-of-00002.safetensors"}})");
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader =
      SafetensorsReader::Open(dir + "/model.safetensors.index.json");
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_THAT((*reader)->files(), ElementsAre(dir + "/model-00001-of-00002.safetensors",
                                              dir + "/model-00002-of-00002.safetensors"));
  ASSERT_EQ((*reader)->tensors().size(), 3u);
  EXPECT_EQ((*reader)->tensors()[0].name, "lm_head.weight");  // sorted by name
  EXPECT_EQ((*reader)->metadata().at("format"), "pt");

  const SafetensorsTensor* head = (*reader)->Find("lm_head.weight");
  ASSERT_NE(head, nullptr);
  EXPECT_EQ(head->file, 1u);
  std::vector<float> out(2);
  ASSERT_TRUE((*reader)->ReadF32(*head, {1, 3}, out).ok());
  EXPECT_THAT(out, ElementsAre(-2.5f, 0.5f));
  const SafetensorsTensor* embed = (*reader)->Find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->file, 0u);
  ASSERT_TRUE((*reader)->ReadF32(*embed, {0, 2}, out).ok());
  EXPECT_THAT(out, ElementsAre(1.0f, 2.0f));
}

TEST(SafetensorsIndexTest, RejectsTensorInTwoFiles) {
  const std::string dir = MakeTestDir();
  WriteModel(dir + "/a.safetensors", {{"x", DType::kFloat32, {1}, Bytes(std::vector<float>{1})}});
  WriteModel(dir + "/b.safetensors", {{"x", DType::kFloat32, {1}, Bytes(std::vector<float>{2})}});
  const std::string index = dir + "/model.safetensors.index.json";
  WriteBytes(index, R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})");
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(index);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr(index));
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr("tensor 'x' is in both"));
}

TEST(SafetensorsIndexTest, RejectsDuplicateNameInWeightMap) {
  const std::string dir = MakeTestDir();
  WriteModel(dir + "/a.safetensors", {{"x", DType::kFloat32, {1}, Bytes(std::vector<float>{1})}});
  const std::string index = dir + "/model.safetensors.index.json";
  WriteBytes(index, R"({"weight_map": {"x": "a.safetensors", "x": "a.safetensors"}})");
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(index);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr("names 'x' more than once"));
}

TEST(SafetensorsIndexTest, RejectsTensorMissingFromItsFile) {
  const std::string dir = MakeTestDir();
  WriteModel(dir + "/a.safetensors", {{"x", DType::kFloat32, {1}, Bytes(std::vector<float>{1})}});
  const std::string index = dir + "/model.safetensors.index.json";
  WriteBytes(index, R"({"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}})");
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(index);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reader.status().message()),
              HasSubstr("puts tensor 'y' in '" + dir + "/a.safetensors', which has no such"));
}

TEST(SafetensorsIndexTest, RejectsTensorTheIndexDoesNotList) {
  const std::string dir = MakeTestDir();
  WriteModel(dir + "/a.safetensors", {{"x", DType::kFloat32, {1}, Bytes(std::vector<float>{1})},
                                      {"z", DType::kFloat32, {1}, Bytes(std::vector<float>{1})}});
  const std::string index = dir + "/model.safetensors.index.json";
  WriteBytes(index, R"({"weight_map": {"x": "a.safetensors"}})");
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(index);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr("holds tensor 'z'"));
}

TEST(SafetensorsIndexTest, RejectsMalformedIndex) {
  const std::string dir = MakeTestDir();
  const std::string index = dir + "/model.safetensors.index.json";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"metadata": {}})", "no \"weight_map\""},
      {R"({"weight_map": {"x": 3}})", "'x' is a JSON number, not a file name"},
      {R"({"weight_map": {"x": "../a.safetensors"}})", "not a path relative"},
      {R"({"weight_map": {"x": "/etc/a.safetensors"}})", "not a path relative"},
      {R"({"weight_map": )", "not valid JSON"},
  };
  for (const auto& [json, problem] : cases) {
    SCOPED_TRACE(json);
    WriteBytes(index, json);
    absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(index);
    EXPECT_EQ(reader.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(reader.status().message()), HasSubstr(index));
    EXPECT_THAT(std::string(reader.status().message()), HasSubstr(problem));
  }
}

TEST(SafetensorsIndexTest, MissingShardIsNotFound) {
  const std::string dir = MakeTestDir();
  const std::string index = dir + "/model.safetensors.index.json";
  WriteBytes(index, R"({"weight_map": {"x": "gone.safetensors"}})");
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(index);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(reader.status().message()), HasSubstr(dir + "/gone.safetensors"));
}

TEST(SafetensorsWriterTest, RefusesBadDeclarations) {
  const std::string path = MakeTestDir() + "/w.safetensors";
  using Headers = std::vector<SafetensorsWriter::TensorHeader>;
  for (const Headers& headers :
       {Headers{{"a", DType::kFloat32, {1}}, {"a", DType::kFloat32, {1}}},
        Headers{{"a", DType::kFloat32, {-1}}}, Headers{{"__metadata__", DType::kFloat32, {1}}},
        Headers{{"a", DType::kFloat32, {int64_t{1} << 62, 4}}}}) {
    EXPECT_EQ(SafetensorsWriter::Create(path, headers, {}).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(SafetensorsWriterTest, EnforcesDeclaredByteCount) {
  const std::string path = MakeTestDir() + "/w.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, {{"a", DType::kFloat32, {2}}}, {});
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::vector<float> one = {1.0f};
  ASSERT_TRUE((*writer)->Append(ByteSpan(one)).ok());
  EXPECT_EQ((*writer)->Finish().code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<float> two = {2.0f, 3.0f};
  EXPECT_EQ((*writer)->Append(ByteSpan(two)).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE((*writer)->Append(ByteSpan(one)).ok());
  EXPECT_TRUE((*writer)->Finish().ok());
  EXPECT_EQ((*writer)->Finish().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SafetensorsWriterTest, OpenFailureNamesThePath) {
  const std::string path = MakeTestDir() + "/no/such/dir/w.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> writer =
      SafetensorsWriter::Create(path, {{"a", DType::kFloat32, {2}}}, {});
  EXPECT_EQ(writer.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(writer.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(writer.status().message()), HasSubstr("No such file or directory"));
}

}  // namespace
}  // namespace layercast
