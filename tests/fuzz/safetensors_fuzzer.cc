// Fuzzes SafetensorsReader::Open on untrusted checkpoint bytes (one file, or
// an index with its files; see safetensors_input.h), served from memory. When
// Open succeeds, reads a few element ranges of each tensor and checks every
// value against an independent decoding of the file's bytes, and that reads
// beyond a tensor are refused with OUT_OF_RANGE.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/safetensors.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/memory_file_system.h"
#include "tests/fuzz/safetensors_input.h"

namespace layercast::fuzz {
namespace {

// Tensors read per input, and elements per read: enough to reach every code
// path (including the widening loop) without making each run slow.
constexpr size_t kMaxTensorsRead = 16;
constexpr uint64_t kElementsPerRead = 64;

// Exact float16 -> float32, written independently of core/cast.
uint32_t HalfToFloatBits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  uint32_t mantissa = h & 0x3FF;
  if (exponent == 0x1F) return sign | 0x7F800000 | (mantissa << 13);  // inf, NaN
  if (exponent != 0) return sign | ((exponent + 112) << 23) | (mantissa << 13);
  if (mantissa == 0) return sign;
  int e = 113;  // subnormal: normalise
  while ((mantissa & 0x400) == 0) {
    mantissa <<= 1;
    --e;
  }
  return sign | (static_cast<uint32_t>(e) << 23) | ((mantissa & 0x3FF) << 13);
}

// The fp32 bits element `index` of `tensor` must read as, from the raw file.
uint32_t ExpectedBits(const SafetensorsTensor& tensor, absl::string_view file, uint64_t index) {
  const uint64_t at = tensor.data_begin + index * DTypeSize(tensor.dtype);
  if (tensor.dtype == DType::kFloat32) {
    uint32_t bits = 0;
    std::memcpy(&bits, file.data() + at, 4);
    return bits;
  }
  uint16_t half = 0;
  std::memcpy(&half, file.data() + at, 2);
  return tensor.dtype == DType::kBFloat16 ? static_cast<uint32_t>(half) << 16
                                          : HalfToFloatBits(half);
}

bool IsNaNBits(uint32_t bits) { return (bits & 0x7F800000) == 0x7F800000 && (bits & 0x7FFFFF); }

void CheckRead(const SafetensorsReader& reader, const SafetensorsTensor& tensor,
               absl::string_view file, ElementRange range) {
  std::vector<float> values(range.size());
  const absl::Status status = reader.ReadF32(tensor, range, values);
  FUZZ_CHECK(status.ok(), "ReadF32 of '%s' [%llu, %llu) failed on a file Open accepted: %s",
             tensor.name.c_str(), static_cast<unsigned long long>(range.begin),
             static_cast<unsigned long long>(range.end), status.ToString().c_str());
  for (uint64_t i = 0; i < range.size(); ++i) {
    uint32_t got = 0;
    std::memcpy(&got, &values[i], 4);
    const uint32_t want = ExpectedBits(tensor, file, range.begin + i);
    // NaNs may come back quiet (the hardware widening sets the quiet bit);
    // sign and payload are kept.
    const bool same =
        IsNaNBits(want) ? IsNaNBits(got) && (got | 0x400000) == (want | 0x400000) : got == want;
    FUZZ_CHECK(same, "tensor '%s' (%s) element %llu read as 0x%08x, its bytes say 0x%08x",
               tensor.name.c_str(), std::string(DTypeSafetensorsName(tensor.dtype)).c_str(),
               static_cast<unsigned long long>(range.begin + i), got, want);
  }
}

void CheckTensor(const SafetensorsReader& reader, const SafetensorsTensor& tensor,
                 const MemoryFileSystem& fs) {
  FUZZ_CHECK(tensor.file < reader.files().size(), "tensor '%s' names file %u of %zu",
             tensor.name.c_str(), tensor.file, reader.files().size());
  const absl::string_view* file = fs.Find(reader.files()[tensor.file]);
  FUZZ_CHECK(file != nullptr, "reader names file '%s' it was not given",
             reader.files()[tensor.file].c_str());
  const uint64_t n = tensor.num_elements;
  uint64_t bytes = 0, end = 0;
  FUZZ_CHECK(!__builtin_mul_overflow(n, DTypeSize(tensor.dtype), &bytes) &&
                 !__builtin_add_overflow(tensor.data_begin, bytes, &end) && end <= file->size(),
             "tensor '%s' claims bytes beyond its %zu-byte file", tensor.name.c_str(),
             file->size());
  uint64_t product = 1;
  for (int64_t dim : tensor.shape) {
    FUZZ_CHECK(dim >= 0, "tensor '%s' has a negative dimension", tensor.name.c_str());
    product *= static_cast<uint64_t>(dim);
  }
  FUZZ_CHECK(product == n, "tensor '%s' has %llu elements but its shape gives %llu",
             tensor.name.c_str(), static_cast<unsigned long long>(n),
             static_cast<unsigned long long>(product));

  const uint64_t k = std::min(n, kElementsPerRead);
  CheckRead(reader, tensor, *file, {0, k});
  CheckRead(reader, tensor, *file, {n - k, n});
  CheckRead(reader, tensor, *file, {n / 3, n / 3 + std::min(n - n / 3, kElementsPerRead)});
  CheckRead(reader, tensor, *file, {n, n});

  // Beyond the tensor: refused, never read.
  float one = 0;
  const absl::Status beyond = reader.ReadF32(tensor, {n, n + 1}, std::span<float>(&one, 1));
  FUZZ_CHECK(beyond.code() == absl::StatusCode::kOutOfRange,
             "reading element %llu of the %llu-element tensor '%s' gave %s, not OUT_OF_RANGE",
             static_cast<unsigned long long>(n), static_cast<unsigned long long>(n),
             tensor.name.c_str(), beyond.ToString().c_str());
}

}  // namespace
}  // namespace layercast::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace layercast;
  fuzz::MemoryFileSystem fs;
  const std::string path =
      fuzz::ServeInput(absl::string_view(reinterpret_cast<const char*>(data), size), fs);
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path, fs);
  if (!reader.ok()) {
    const absl::StatusCode code = reader.status().code();
    // A checkpoint is refused as malformed, or because a file it names is
    // missing or too short; nothing else.
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound ||
                   code == absl::StatusCode::kOutOfRange,
               "Open refused with an unexpected code: %s", reader.status().ToString().c_str());
    FUZZ_CHECK(!reader.status().message().empty(), "Open refused without a message");
    return 0;
  }
  const std::vector<SafetensorsTensor>& tensors = (*reader)->tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i > 0) {
      FUZZ_CHECK(tensors[i - 1].name < tensors[i].name, "tensors not sorted by unique name: %s, %s",
                 tensors[i - 1].name.c_str(), tensors[i].name.c_str());
    }
    FUZZ_CHECK((*reader)->Find(tensors[i].name) == &tensors[i], "Find('%s') misses it",
               tensors[i].name.c_str());
    if (i < fuzz::kMaxTensorsRead) fuzz::CheckTensor(**reader, tensors[i], fs);
  }
  return 0;
}
