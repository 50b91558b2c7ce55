#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client_defaults.h"
#include "client/shard_set.h"
#include "core/dtype.h"
#include "platform/file_system.h"

namespace layercast::client {

struct ExportOptions {
  // A path ending in ".safetensors". A model larger than max_file_bytes is
  // written as Hugging Face shards it: "<stem>-00001-of-0000N.safetensors"
  // beside it and "<path>.index.json" naming which file holds each tensor.
  std::string path;
  // float32 writes the fp32 master as it is; bfloat16 and float16 a cast
  // of it, as a shard casts. 8-bit floats are refused: a safetensors file
  // has no agreed place for their block scales.
  DType dtype = DType::kFloat32;
  // The version to export; unset: the version the shards are at when the
  // export starts (walked again at the newer one, at most 3 times, should a
  // step move a layer past what the shards keep in `dtype` mid-walk).
  std::optional<uint64_t> version;
  // Hugging Face's save_pretrained default ("5GB"). A tensor larger than
  // this gets a file of its own.
  uint64_t max_file_bytes = 5'000'000'000;
  // Each layer's gather ends by then.
  std::chrono::milliseconds layer_timeout = kLayerTimeout;
  // Told after each layer is written: its index and the bytes so far.
  std::function<void(uint32_t layer, uint64_t bytes)> on_layer;
};

struct ExportResult {
  uint64_t version = 0;  // every tensor's parameter version
  uint64_t bytes = 0;    // tensor bytes written
  uint64_t tensors = 0;
  std::vector<std::string> files;  // the data files, then the index if any
};

// Writes every tensor the shards serve, named and shaped as the manifest
// says, at one version, as a safetensors model that safetensors, PyTorch
// and Hugging Face transformers load, and that a shard serves again
// (--model). Files are written beside their final names and renamed into
// place once all of them are complete; a failed export removes what it
// wrote, and a successful one replaces an earlier export to `path` in the
// other form (one file, or split with an index), which a loader would
// otherwise read instead. Metadata: "format" "pt", and layercast's
// version, policy and content fingerprint.
// Errors: INVALID_ARGUMENT for a path without ".safetensors" or an 8-bit
// dtype; the gathers' (ABORTED when a pinned `version` is no longer kept);
// the file system's, naming the file.
absl::StatusOr<ExportResult> ExportModel(const ShardSet& set, const ExportOptions& options,
                                         FileSystem& fs = DefaultFileSystem());

}  // namespace layercast::client
