#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/safetensors.h"
#include "platform/file_system.h"

namespace layercast {

// Where each tensor of a safetensors model goes when the model is larger
// than one file should be, as Hugging Face's save_pretrained splits it:
// tensors in the order given, a new file begun when the next tensor would
// take a non-empty file past the limit (so a tensor larger than the limit
// gets a file of its own). One file keeps the path; several are named
// "<stem>-00001-of-0000N.safetensors" beside it, and "<path>.index.json"
// names which file holds each tensor. The shards' --model and
// --optimizer-state, ShardSet.export and the Python package all read and
// write this one layout.
struct SafetensorsSplit {
  std::vector<std::vector<SafetensorsWriter::TensorHeader>> files;  // each file's tensors
  std::vector<std::string> paths;                                   // each file's final path
  std::vector<uint32_t> file_of;  // per tensor, in the order given
  uint64_t bytes = 0;             // every tensor's bytes

  bool split() const { return paths.size() > 1; }
};

// The split of `tensors` for `path` (ending in ".safetensors"), at most
// `max_file_bytes` in a file unless a single tensor is larger (0 counts as
// 1). INVALID_ARGUMENT for another path, a name given twice or a tensor
// whose size overflows.
absl::StatusOr<SafetensorsSplit> PlanSafetensorsSplit(
    const std::vector<SafetensorsWriter::TensorHeader>& tensors, uint64_t max_file_bytes,
    const std::string& path);

// The index of a split model: {"metadata": {"total_size": bytes},
// "weight_map": {tensor: file name beside the index}}, as Hugging Face
// writes it, indented by 2, ending in a newline.
std::string SafetensorsIndexJson(const SafetensorsSplit& split);

// Writes SafetensorsIndexJson to `index_path` through "<index_path>.partial"
// and a rename, so a reader never finds half an index.
absl::Status WriteSafetensorsIndex(const SafetensorsSplit& split, const std::string& index_path,
                                   FileSystem& fs = DefaultFileSystem());

}  // namespace layercast
