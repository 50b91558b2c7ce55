// SafetensorsWriter: lays tensors out densely in declared order, as the
// reference implementation does, so the header can be written before any data.

#include <set>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "nlohmann/json.hpp"
#include "platform/status_macros.h"

namespace layercast {
namespace {

// Keeps keys in insertion order: __metadata__ first, then tensors as declared,
// which makes files easy to read by eye.
using OrderedJson = nlohmann::ordered_json;

absl::Status Invalid(const std::string& path, std::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors writer for '", path, "': ", std::string(problem)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, const std::vector<TensorHeader>& tensors,
    const std::map<std::string, std::string>& metadata, FileSystem& fs) {
  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
  writer->path_ = path;
  // The header is checked before the file is created or truncated.
  ASSIGN_OR_RETURN(std::string header, writer->EncodeHeader(tensors, metadata));
  ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs.OpenForWrite(path));
  RETURN_IF_ERROR(writer->Start(std::move(file), header));
  return writer;
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    std::unique_ptr<WritableFile> file, const std::string& path,
    const std::vector<TensorHeader>& tensors, const std::map<std::string, std::string>& metadata) {
  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
  writer->path_ = path;
  ASSIGN_OR_RETURN(std::string header, writer->EncodeHeader(tensors, metadata));
  RETURN_IF_ERROR(writer->Start(std::move(file), header));
  return writer;
}

absl::StatusOr<std::string> SafetensorsWriter::EncodeHeader(
    const std::vector<TensorHeader>& tensors, const std::map<std::string, std::string>& metadata) {
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorHeader& tensor : tensors) {
    if (tensor.name.empty() || tensor.name == "__metadata__") {
      return Invalid(path_, absl::StrCat("'", tensor.name, "' cannot name a tensor"));
    }
    if (!names.insert(tensor.name).second) {
      return Invalid(path_, absl::StrCat("tensor '", tensor.name, "' is declared twice"));
    }
    uint64_t bytes = tensor.dtype.size();
    for (int64_t dim : tensor.shape) {
      if (dim < 0) {
        return Invalid(path_,
                       absl::StrCat("tensor '", tensor.name, "' has negative dimension ", dim));
      }
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes)) {
        return Invalid(
            path_, absl::StrCat("tensor '", tensor.name, "' has more bytes than fit in 64 bits"));
      }
    }
    uint64_t end = 0;
    if (__builtin_add_overflow(offset, bytes, &end)) {
      return Invalid(path_, "the tensors together have more bytes than fit in 64 bits");
    }
    header[tensor.name] = {{"dtype", std::string(tensor.dtype.name())},
                           {"shape", tensor.shape},
                           {"data_offsets", {offset, end}}};
    offset = end;
  }

  std::string text;
  // dump() throws on strings that are not UTF-8; JSON cannot carry them.
  try {
    text = header.dump();
  } catch (const OrderedJson::exception& e) {
    return Invalid(path_,
                   absl::StrCat("a tensor name or metadata string is not UTF-8: ", e.what()));
  }
  // Padding keeps the data section 8-byte aligned for readers that map it.
  text.append((8 - text.size() % 8) % 8, ' ');
  expected_bytes_ = offset;
  return text;
}

absl::Status SafetensorsWriter::Start(std::unique_ptr<WritableFile> file,
                                      const std::string& header) {
  uint8_t prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  RETURN_IF_ERROR(file->Append(prefix));
  RETURN_IF_ERROR(file->Append(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(header.data()), header.size())));
  file_ = std::move(file);
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Append(std::span<const uint8_t> bytes) {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("safetensors writer for '", path_, "': Append after Finish"));
  }
  if (bytes.size() > expected_bytes_ - written_bytes_) {
    return absl::OutOfRangeError(absl::StrCat(
        "safetensors writer for '", path_, "': appending ", bytes.size(), " bytes after ",
        written_bytes_, " would exceed the ", expected_bytes_, " bytes the header declares"));
  }
  RETURN_IF_ERROR(file_->Append(bytes));
  written_bytes_ += bytes.size();
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("safetensors writer for '", path_, "': Finish called twice"));
  }
  if (written_bytes_ != expected_bytes_) {
    return absl::FailedPreconditionError(
        absl::StrCat("safetensors writer for '", path_, "': only ", written_bytes_, " of the ",
                     expected_bytes_, " data bytes the header declares were appended"));
  }
  RETURN_IF_ERROR(file_->Sync());
  std::unique_ptr<WritableFile> file = std::move(file_);
  return file->Close();
}

}  // namespace layercast
