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
// Far above any index (a few MB for the largest models): a larger file at
// the index's path is not one, and names nothing to remove.
constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;

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

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// The files an index already at `index_path` names beside it, as the
// reader finds them; none where there is no index or it does not read as
// one, so nothing is removed on a guess.
std::vector<std::string> FilesNamedBy(const std::string& index_path, FileSystem& fs) {
  if (!fs.Exists(index_path)) return {};
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> file = fs.OpenForRead(index_path);
  if (!file.ok() || (*file)->size() > kMaxIndexBytes) return {};
  std::string text((*file)->size(), '\0');
  if (!(*file)->ReadAt(0, {reinterpret_cast<uint8_t*>(text.data()), text.size()}).ok()) return {};
  const nlohmann::json index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!index.is_object()) return {};
  const auto weight_map = index.find("weight_map");
  if (weight_map == index.end() || !weight_map->is_object()) return {};
  const size_t slash = index_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : index_path.substr(0, slash + 1);
  std::set<std::string> files;
  for (const auto& [tensor, name] : weight_map->items()) {
    if (!name.is_string()) continue;
    const std::string& file_name = name.get_ref<const std::string&>();
    if (file_name.find('/') != std::string::npos || !absl::EndsWith(file_name, kSuffix)) continue;
    files.insert(dir + file_name);
  }
  return {files.begin(), files.end()};
}

absl::Status RemoveIfThere(const std::string& path, FileSystem& fs) {
  return fs.Exists(path) ? fs.Remove(path) : absl::OkStatus();
}

}  // namespace

std::string SafetensorsIndexPath(const std::string& path) { return path + ".index.json"; }

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
  split.path = path;
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

absl::StatusOr<std::vector<std::string>> PlaceSafetensorsSplit(
    const SafetensorsSplit& split,
    const std::function<absl::Status(const std::vector<std::string>& partial_paths)>& write_files,
    FileSystem& fs) {
  const std::string index = SafetensorsIndexPath(split.path);
  // Read before this split's index replaces it.
  const std::vector<std::string> earlier = FilesNamedBy(index, fs);
  std::vector<std::string> partials;
  for (const std::string& file : split.paths) partials.push_back(file + ".partial");
  std::vector<std::string> placed;
  const absl::Status written = [&]() -> absl::Status {
    RETURN_IF_ERROR(write_files(partials));
    for (size_t f = 0; f < split.paths.size(); ++f) {
      RETURN_IF_ERROR(fs.Rename(partials[f], split.paths[f]));
      placed.push_back(split.paths[f]);
    }
    if (split.split()) {
      RETURN_IF_ERROR(WriteSafetensorsIndex(split, index, fs));
      placed.push_back(index);
    }
    return absl::OkStatus();
  }();
  if (!written.ok()) {
    // No part of a model that is not whole stays behind.
    partials.push_back(index + ".partial");
    for (const std::string& file : partials) RemoveIfThere(file, fs).IgnoreError();
    for (const std::string& file : placed) fs.Remove(file).IgnoreError();
    return written;
  }
  // The index goes before the files it names: never an index naming files
  // that are gone.
  RETURN_IF_ERROR(RemoveIfThere(split.split() ? split.path : index, fs));
  const std::set<std::string> kept(split.paths.begin(), split.paths.end());
  for (const std::string& file : earlier) {
    if (!kept.contains(file)) RETURN_IF_ERROR(RemoveIfThere(file, fs));
  }
  RETURN_IF_ERROR(fs.SyncDir(DirectoryOf(split.path)));
  return placed;
}

}  // namespace layercast
