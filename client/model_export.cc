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
// tensors).
absl::StatusOr<SafetensorsSplit> PlanFiles(const ModelSpec& model, DType dtype,
                                           uint64_t max_file_bytes, const std::string& path) {
  std::vector<SafetensorsWriter::TensorHeader> tensors;
  for (const LayerSpec& layer : model.layers) {
    for (const TensorSpec& tensor : layer.tensors) {
      tensors.push_back({tensor.name, dtype, tensor.shape});
    }
  }
  return PlanSafetensorsSplit(tensors, max_file_bytes, path);
}

// One walk of every layer at `version` into the partial files.
absl::StatusOr<uint64_t> WriteAt(const ShardSet& set, const ExportOptions& options,
                                 const SafetensorsSplit& plan,
                                 const std::vector<std::string>& partial_paths,
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
    ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> out, fs.OpenForWrite(partial_paths[file]));
    ASSIGN_OR_RETURN(writer, SafetensorsWriter::Create(std::move(out), partial_paths[file],
                                                       plan.files[file], metadata));
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
  for (int file = open_file + 1; file < static_cast<int>(plan.files.size()); ++file) {
    RETURN_IF_ERROR(switch_to(file));
  }
  RETURN_IF_ERROR(writer->Finish());
  return written;
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
  ASSIGN_OR_RETURN(const SafetensorsSplit plan,
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
  uint64_t written = 0;
  const auto write_files = [&](const std::vector<std::string>& partial_paths) -> absl::Status {
    for (int walk = 1;; ++walk) {
      metadata["layercast_version"] = absl::StrCat(result.version);
      const absl::StatusOr<uint64_t> bytes =
          WriteAt(set, options, plan, partial_paths, metadata, result.version, fs);
      if (bytes.ok()) {
        written = *bytes;
        return absl::OkStatus();
      }
      if (!absl::IsAborted(bytes.status()) || options.version || walk == kWalks) {
        return bytes.status();
      }
      ASSIGN_OR_RETURN(const uint64_t now, set.CurrentVersion());
      Log()->info("exporting again at version {}: {}", now, bytes.status().message());
      result.version = now;
    }
  };
  ASSIGN_OR_RETURN(result.files, PlaceSafetensorsSplit(plan, write_files, fs));
  result.bytes = written;
  result.tensors = plan.file_of.size();
  return result;
}

}  // namespace layercast::client
