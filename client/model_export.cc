#include "client/model_export.h"

#include <map>
#include <memory>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "core/safetensors_split.h"
#include "platform/log.h"
#include "platform/status_macros.h"

namespace layercast::client {
namespace {

constexpr absl::string_view kSuffix = ".safetensors";
// Walks again at the newer version when a training step moved a layer past
// what the shards keep in the export's dtype.
constexpr int kWalks = 4;

// The split of every tensor, in manifest order (layers, then their
// tensors), and each file's partial path, renamed into place once all are
// complete.
struct FilePlan {
  SafetensorsSplit split;
  std::vector<std::string> partial_paths;
};

absl::StatusOr<FilePlan> PlanFiles(const ModelSpec& model, DType dtype, uint64_t max_file_bytes,
                                   const std::string& path) {
  std::vector<SafetensorsWriter::TensorHeader> tensors;
  for (const LayerSpec& layer : model.layers) {
    for (const TensorSpec& tensor : layer.tensors) {
      tensors.push_back({tensor.name, dtype, tensor.shape});
    }
  }
  FilePlan plan;
  ASSIGN_OR_RETURN(plan.split, PlanSafetensorsSplit(tensors, max_file_bytes, path));
  for (const std::string& file : plan.split.paths) plan.partial_paths.push_back(file + ".partial");
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
                                                       plan.split.files[file], metadata));
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
      RETURN_IF_ERROR(switch_to(static_cast<int>(plan.split.file_of[tensor_index++])));
      RETURN_IF_ERROR(writer->Append({buffer.data() + placed.byte_offset, placed.num_bytes()}));
      written += placed.num_bytes();
    }
    if (options.on_layer) options.on_layer(l, written);
  }
  // Files past the last tensor's (none, unless the model has no tensors).
  for (int file = open_file + 1; file < static_cast<int>(plan.split.files.size()); ++file) {
    RETURN_IF_ERROR(switch_to(file));
  }
  RETURN_IF_ERROR(writer->Finish());
  return written;
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
  ASSIGN_OR_RETURN(const FilePlan plan,
                   PlanFiles(set.model(), options.dtype, options.max_file_bytes, options.path));
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
  const bool split = plan.split.split();
  const std::string index = options.path + ".index.json";
  const absl::Status placed = [&]() -> absl::Status {
    RETURN_IF_ERROR(written.status());
    for (size_t f = 0; f < plan.split.paths.size(); ++f) {
      RETURN_IF_ERROR(fs.Rename(plan.partial_paths[f], plan.split.paths[f]));
      result.files.push_back(plan.split.paths[f]);
    }
    if (split) {
      RETURN_IF_ERROR(WriteSafetensorsIndex(plan.split, index, fs));
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
  result.tensors = plan.split.file_of.size();
  return result;
}

}  // namespace layercast::client
