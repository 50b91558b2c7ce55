#pragma once

#include <cstdint>
#include <functional>
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
// "<stem>-00001-of-0000N.safetensors" beside it, and
// SafetensorsIndexPath(path) names which file holds each tensor. The
// shards' --model and --optimizer-state, ShardSet.export and the Python
// package all read and write this one layout.
struct SafetensorsSplit {
  std::string path;  // the path planned for: the one file, or the index's stem
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

// "<path>.index.json": where the index of a model split at `path` lies.
std::string SafetensorsIndexPath(const std::string& path);

// The index of a split model: {"metadata": {"total_size": bytes},
// "weight_map": {tensor: file name beside the index}}, the fields Hugging
// Face writes, indented by 2, ending in a newline. The weight_map keeps the
// tensors' order, file by file, where Hugging Face sorts it by name: readers
// look names up, and the order shows how the files were filled.
std::string SafetensorsIndexJson(const SafetensorsSplit& split);

// Writes SafetensorsIndexJson to `index_path` through "<index_path>.partial"
// and a rename, so a reader never finds half an index.
absl::Status WriteSafetensorsIndex(const SafetensorsSplit& split, const std::string& index_path,
                                   FileSystem& fs = DefaultFileSystem());

// Writes the model `split` plans at split.path, whole or not at all:
// `write_files` fills every file at the partial path it is given
// ("<file>.partial", one per split.paths entry, in that order); once it
// succeeds they are renamed into place and, for several files, the index
// written. An earlier model at the same path in the other form is then
// removed: the single file under a split, the index and the files it names
// under one file (a loader finding both takes one of them: transformers the
// file, a shard's folder the index), and files an earlier index named that
// this split does not. If writing or placing fails, nothing written here
// stays behind and its error is returned. Returns the files written, the
// index last.
absl::StatusOr<std::vector<std::string>> PlaceSafetensorsSplit(
    const SafetensorsSplit& split,
    const std::function<absl::Status(const std::vector<std::string>& partial_paths)>& write_files,
    FileSystem& fs = DefaultFileSystem());

}  // namespace layercast
