#include "core/safetensors_split.h"

#include <algorithm>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "platform/status_macros.h"

namespace layercast {
namespace {

constexpr absl::string_view kSuffix = ".safetensors";

// The bytes a tensor holds; false when they do not fit in 64 bits.
bool TensorBytes(const SafetensorsWriter::TensorHeader& tensor, uint64_t& bytes) {
  bytes = tensor.dtype.size();
  for (const int64_t dim : tensor.shape) {
    if (dim < 0) return false;
    const uint64_t extent = static_cast<uint64_t>(dim);
    if (extent != 0 && bytes > UINT64_MAX / extent) return false;
    bytes *= extent;
  }
  return true;
}

}  // namespace

absl::StatusOr<SafetensorsSplit> PlanSafetensorsSplit(
    const std::vector<SafetensorsWriter::TensorHeader>& tensors, uint64_t max_file_bytes,
    const std::string& path) {
  if (!absl::EndsWith(path, kSuffix) || path.size() == kSuffix.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the path '", path,
                     "' does not end in .safetensors: name the file, e.g. model.safetensors"));
  }
  max_file_bytes = std::max<uint64_t>(1, max_file_bytes);
  SafetensorsSplit split;
  split.files.emplace_back();
  uint64_t in_file = 0;
  // A name in two files would be one entry of the index.
  std::set<std::string> names;
  for (const SafetensorsWriter::TensorHeader& tensor : tensors) {
    if (!names.insert(tensor.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor.name, "' for '", path, "' is given twice"));
    }
    uint64_t bytes = 0;
    if (!TensorBytes(tensor, bytes) || split.bytes > UINT64_MAX - bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor.name, "' for '", path,
                       "' has a shape whose size in bytes does not fit in 64 bits"));
    }
    if (in_file > 0 && in_file + bytes > max_file_bytes) {
      split.files.emplace_back();
      in_file = 0;
    }
    split.files.back().push_back(tensor);
    split.file_of.push_back(static_cast<uint32_t>(split.files.size() - 1));
    in_file += bytes;
    split.bytes += bytes;
  }
  const size_t files = split.files.size();
  const std::string stem = path.substr(0, path.size() - kSuffix.size());
  for (size_t f = 0; f < files; ++f) {
    split.paths.push_back(files == 1 ? path
                                     : absl::StrFormat("%s-%05d-of-%05d%s", stem, f + 1, files,
                                                       std::string(kSuffix)));
  }
  return split;
}

std::string SafetensorsIndexJson(const SafetensorsSplit& split) {
  nlohmann::ordered_json index;
  index["metadata"]["total_size"] = split.bytes;
  nlohmann::ordered_json& weight_map = index["weight_map"];
  weight_map = nlohmann::ordered_json::object();
  for (size_t f = 0; f < split.files.size(); ++f) {
    const std::string& file = split.paths[f];
    const size_t slash = file.rfind('/');
    for (const SafetensorsWriter::TensorHeader& header : split.files[f]) {
      weight_map[header.name] = slash == std::string::npos ? file : file.substr(slash + 1);
    }
  }
  return index.dump(2) + "\n";
}

absl::Status WriteSafetensorsIndex(const SafetensorsSplit& split, const std::string& index_path,
                                   FileSystem& fs) {
  const std::string text = SafetensorsIndexJson(split);
  const std::string partial = index_path + ".partial";
  ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out, fs.OpenForWrite(partial));
  RETURN_IF_ERROR(out->Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()}));
  RETURN_IF_ERROR(out->Sync());
  RETURN_IF_ERROR(out->Close());
  return fs.Rename(partial, index_path);
}

}  // namespace layercast
