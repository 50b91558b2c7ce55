#include "client/model_export.h"

#include <algorithm>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/safetensors.h"
#include "platform/log.h"
#include "platform/status_macros.h"

namespace layercast::client {
namespace {

constexpr absl::string_view kSuffix = ".safetensors";
// Walks again at the newer version when a training step moved a layer past
// what the shards keep in the export's dtype.
constexpr int kWalks = 4;

// Which data file each tensor goes to, in manifest order (layers, then
// their tensors), and each file's final and partial paths.
struct FilePlan {
  std::vector<std::vector<SafetensorsWriter::TensorHeader>> headers;  // per file
  std::vector<uint32_t> file_of;                                      // per tensor, in order
  std::vector<std::string> paths, partial_paths;
  uint64_t bytes = 0;
};

FilePlan PlanFiles(const ModelSpec& model, DType dtype, uint64_t max_file_bytes,
                   const std::string& path) {
  FilePlan plan;
  plan.headers.emplace_back();
  uint64_t in_file = 0;
  for (const LayerSpec& layer : model.layers) {
    for (const TensorSpec& tensor : layer.tensors) {
      const uint64_t bytes = tensor.num_elements * DTypeSize(dtype);
      if (in_file > 0 && in_file + bytes > max_file_bytes) {
        plan.headers.emplace_back();
        in_file = 0;
      }
      plan.headers.back().push_back({tensor.name, dtype, tensor.shape});
      plan.file_of.push_back(static_cast<uint32_t>(plan.headers.size() - 1));
      in_file += bytes;
      plan.bytes += bytes;
    }
  }
  const size_t files = plan.headers.size();
  const std::string stem = path.substr(0, path.size() - kSuffix.size());
  for (size_t f = 0; f < files; ++f) {
    plan.paths.push_back(files == 1 ? path
                                    : absl::StrFormat("%s-%05d-of-%05d%s", stem, f + 1, files,
                                                      std::string(kSuffix)));
    plan.partial_paths.push_back(plan.paths.back() + ".partial");
  }
  return plan;
}

// One walk of every layer at `version` into the partial files.
absl::StatusOr<uint64_t> WriteAt(const ShardSet& set, const ExportOptions& options,
                                 const FilePlan& plan,
                                 const std::map<std::string, std::string>& metadata,
                                 uint64_t version, FileSystem& fs) {
  const wire::ShardSetView& view = set.view();
  std::unique_ptr<SafetensorsWriter> writer;
  int open_file = -1;
  uint64_t written = 0;
  size_t tensor_index = 0;
  // Opens file `file` once the one before it is complete.
  const auto switch_to = [&](int file) -> absl::Status {
    if (file == open_file) return absl::OkStatus();
    if (writer != nullptr) RETURN_IF_ERROR(writer->Finish());
    ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out, fs.OpenForWrite(plan.partial_paths[file]));
    ASSIGN_OR_RETURN(writer, SafetensorsWriter::Create(std::move(out), plan.partial_paths[file],
                                                       plan.headers[file], metadata));
    open_file = file;
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(switch_to(0));
  // Every layer from the incarnations the first came from: one model.
  PinnedIdentity identity;
  for (uint32_t l = 0; l < view.model.layers.size(); ++l) {
    ASSIGN_OR_RETURN(const AssembledLayout layout,
                     LayoutIn(view.layouts[l], options.dtype, view.policy.fp8_block()));
    if (layout.tensors().empty()) continue;
    ASSIGN_OR_RETURN(LayerBuffer buffer, LayerBuffer::Allocate(layout.total_bytes()));
    GatherOptions gather;
    gather.timeout = options.layer_timeout;
    gather.exact_version = version;
    gather.pinned_identity = &identity;
    gather.dtype = options.dtype;
    RETURN_IF_ERROR(
        set.GatherInto(l, gather, std::span<uint8_t>(buffer.data(), buffer.size())).status());
    for (const AssembledTensor& placed : layout.tensors()) {
      RETURN_IF_ERROR(switch_to(static_cast<int>(plan.file_of[tensor_index++])));
      RETURN_IF_ERROR(writer->Append({buffer.data() + placed.byte_offset, placed.num_bytes()}));
      written += placed.num_bytes();
    }
    if (options.on_layer) options.on_layer(l, written);
  }
  // Files past the last tensor's (none, unless the model has no tensors).
  for (int file = open_file + 1; file < static_cast<int>(plan.headers.size()); ++file) {
    RETURN_IF_ERROR(switch_to(file));
  }
  RETURN_IF_ERROR(writer->Finish());
  return written;
}

absl::Status WriteIndex(const FilePlan& plan, const std::string& path, FileSystem& fs) {
  nlohmann::ordered_json index;
  index["metadata"]["total_size"] = plan.bytes;
  nlohmann::ordered_json& weight_map = index["weight_map"];
  for (size_t f = 0; f < plan.headers.size(); ++f) {
    const std::string& file = plan.paths[f];
    const size_t slash = file.rfind('/');
    for (const SafetensorsWriter::TensorHeader& header : plan.headers[f]) {
      weight_map[header.name] = slash == std::string::npos ? file : file.substr(slash + 1);
    }
  }
  const std::string text = index.dump(2) + "\n";
  const std::string partial = path + ".partial";
  ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out, fs.OpenForWrite(partial));
  RETURN_IF_ERROR(out->Append({reinterpret_cast<const uint8_t*>(text.data()), text.size()}));
  RETURN_IF_ERROR(out->Sync());
  RETURN_IF_ERROR(out->Close());
  return fs.Rename(partial, path);
}

std::string DirectoryOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

absl::StatusOr<ExportResult> ExportModel(const ShardSet& set, const ExportOptions& options,
                                         FileSystem& fs) {
  if (!absl::EndsWith(options.path, kSuffix) || options.path.size() == kSuffix.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the export's path '", options.path,
                     "' does not end in .safetensors: name the file, e.g. model.safetensors"));
  }
  if (IsFloat8(options.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot export in ", DTypeName(options.dtype),
        ": a safetensors file has no agreed place for its block scales; export float32, bfloat16 "
        "or float16"));
  }
  const FilePlan plan = PlanFiles(set.model(), options.dtype,
                                  std::max<uint64_t>(1, options.max_file_bytes), options.path);
  std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"layercast_policy", set.view().policy.ToString()},
      {"layercast_content_fingerprint",
       absl::BytesToHexString(set.manifests()[0].content_fingerprint())},
  };
  ExportResult result;
  if (options.version) {
    result.version = *options.version;
  } else {
    ASSIGN_OR_RETURN(result.version, set.CurrentVersion());
  }
  absl::StatusOr<uint64_t> written;
  for (int walk = 1;; ++walk) {
    metadata["layercast_version"] = absl::StrCat(result.version);
    written = WriteAt(set, options, plan, metadata, result.version, fs);
    if (written.ok() || !absl::IsAborted(written.status()) || options.version || walk == kWalks) {
      break;
    }
    const absl::StatusOr<uint64_t> now = set.CurrentVersion();
    if (!now.ok()) {
      written = now.status();
      break;
    }
    Log()->info("exporting again at version {}: {}", *now, written.status().message());
    result.version = *now;
  }
  const bool split = plan.paths.size() > 1;
  const std::string index = options.path + ".index.json";
  const absl::Status placed = [&]() -> absl::Status {
    RETURN_IF_ERROR(written.status());
    for (size_t f = 0; f < plan.paths.size(); ++f) {
      RETURN_IF_ERROR(fs.Rename(plan.partial_paths[f], plan.paths[f]));
      result.files.push_back(plan.paths[f]);
    }
    if (split) {
      RETURN_IF_ERROR(WriteIndex(plan, index, fs));
      result.files.push_back(index);
    }
    return absl::OkStatus();
  }();
  if (!placed.ok()) {
    // No part of a model that is not whole stays behind.
    std::vector<std::string> partials = plan.partial_paths;
    partials.push_back(index + ".partial");
    for (const std::string& file : partials) {
      if (fs.Exists(file)) fs.Remove(file).IgnoreError();
    }
    for (const std::string& file : result.files) fs.Remove(file).IgnoreError();
    return placed;
  }
  // An earlier export to the same path in the other form would be read
  // instead of this one (a loader finding both takes the single file).
  if (const std::string other = split ? options.path : index; fs.Exists(other)) {
    RETURN_IF_ERROR(fs.Remove(other));
  }
  RETURN_IF_ERROR(fs.SyncDir(DirectoryOf(options.path)));
  result.bytes = *written;
  result.tensors = plan.file_of.size();
  return result;
}

}  // namespace layercast::client
