#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/layout.h"
#include "core/safetensors_dtype.h"
#include "platform/file_system.h"

namespace layercast {

// Largest safetensors JSON header accepted, as the reference implementation
// (100 MB); a larger declared length is refused before anything is allocated.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// One tensor of a safetensors file (or of a multi-file index).
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t num_elements = 0;
  uint32_t file = 0;        // index into SafetensorsReader::files()
  uint64_t data_begin = 0;  // absolute byte offset of element 0 in that file
};

// A tensor of an integer or boolean dtype (IntegerDType: position ids,
// masks), which layercast does not serve: its header entry is checked
// like any other, then it is left out of the model. docs/decisions.md says
// why it is skipped rather than served as it is.
struct SafetensorsSkipped {
  std::string name;
  std::string dtype;  // as the file names it, e.g. "I32"
  std::vector<int64_t> shape;
  // Where its bytes are, checked as a served tensor's: for a reader that
  // takes every tensor (the Python package's load_safetensors).
  uint32_t file = 0;
  uint64_t data_begin = 0;
  uint64_t bytes = 0;
};

// Reads a safetensors model: one `.safetensors` file, or a
// `model.safetensors.index.json` naming several. Every header is validated on
// Open (length, JSON, dtypes, shapes without overflow, offsets in range and
// non-overlapping, shape x dtype size == byte span); every error names the
// file and the problem. Thread-safe after Open: ReadF32 may run concurrently.
class SafetensorsReader {
 public:
  // `fs` must outlive the reader.
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(
      const std::string& path, FileSystem& fs = DefaultFileSystem());

  // All tensors of a dtype layercast serves (F32, BF16, F16), sorted by name.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // The others, sorted by name.
  const std::vector<SafetensorsSkipped>& skipped() const { return skipped_; }
  // Paths of the data files, in the order SafetensorsTensor::file indexes.
  const std::vector<std::string>& files() const { return file_paths_; }
  // The `__metadata__` of the (first) file.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when there is no such tensor.
  const SafetensorsTensor* Find(const std::string& name) const;

  // Reads elements `range` of `tensor`, exactly those bytes, widened to fp32.
  // REQUIRES: dst.size() == range.size(). OUT_OF_RANGE if range exceeds the
  // tensor.
  absl::Status ReadF32(const SafetensorsTensor& tensor, ElementRange range,
                       std::span<float> dst) const;

 private:
  SafetensorsReader() = default;
  std::vector<SafetensorsTensor> tensors_;
  std::vector<SafetensorsSkipped> skipped_;
  std::vector<std::string> file_paths_;
  std::vector<std::unique_ptr<RandomAccessFile>> files_;
  std::map<std::string, std::string> metadata_;
};

// Writes one safetensors file sequentially: the header (all tensors declared
// up front), then each tensor's bytes in the declared order. Not thread-safe.
class SafetensorsWriter {
 public:
  struct TensorHeader {
    std::string name;
    // A float DType or an integer one (IntegerDType): the Python package
    // writes a state_dict()'s integer buffers and torch's optimizer steps.
    SafetensorsDType dtype = DType::kFloat32;
    std::vector<int64_t> shape;
  };

  // Creates `path` (truncating) and writes the header. Tensor data follows in
  // `tensors` order, each padded to nothing (safetensors is dense).
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, const std::vector<TensorHeader>& tensors,
      const std::map<std::string, std::string>& metadata, FileSystem& fs = DefaultFileSystem());
  // As above, on `file`, which the caller opened (for instance new and
  // private, FileSystem::CreatePrivate) and which is at its start; `path`
  // names it in messages.
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      std::unique_ptr<WritableFile> file, const std::string& path,
      const std::vector<TensorHeader>& tensors, const std::map<std::string, std::string>& metadata);

  // Appends raw little-endian bytes of the current tensor(s). The total must
  // equal the sum of the declared tensors' sizes by Finish().
  absl::Status Append(std::span<const uint8_t> bytes);
  // Checks every declared byte was written, fsyncs and closes.
  absl::Status Finish();

 private:
  SafetensorsWriter() = default;
  // The header for `tensors` and `metadata`, checked and padded; sets
  // expected_bytes_.
  absl::StatusOr<std::string> EncodeHeader(const std::vector<TensorHeader>& tensors,
                                           const std::map<std::string, std::string>& metadata);
  // Writes the length prefix and `header` to `file`, which becomes file_.
  absl::Status Start(std::unique_ptr<WritableFile> file, const std::string& header);

  std::unique_ptr<WritableFile> file_;
  std::string path_;
  uint64_t expected_bytes_ = 0;
  uint64_t written_bytes_ = 0;
};

}  // namespace layercast
