#pragma once

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "tests/fuzz/memory_file_system.h"

namespace layercast::fuzz {

// How safetensors_fuzzer reads its input (and make_fuzz_seeds writes it):
//
//   - by default the whole input is one file, served at kSingleFilePath;
//   - an input that starts with kIndexMagic is a multi-file checkpoint: the
//     rest is split at every kFileSeparator; the first part is served at
//     kIndexPath and part k (k >= 1) at ShardPath(k), the names an index's
//     weight_map can refer to ("model-1.safetensors", ...).
inline constexpr absl::string_view kSingleFilePath = "ckpt/model.safetensors";
inline constexpr absl::string_view kIndexPath = "ckpt/model.safetensors.index.json";
inline constexpr absl::string_view kIndexMagic = "#index\n";
inline constexpr absl::string_view kFileSeparator = "\n#file\n";

inline std::string ShardName(size_t k) { return absl::StrCat("model-", k, ".safetensors"); }
inline std::string ShardPath(size_t k) { return absl::StrCat("ckpt/", ShardName(k)); }

// Serves `data` in `fs` as described above; returns the path to open. The
// files reference `data`, which must outlive `fs`.
inline std::string ServeInput(absl::string_view data, MemoryFileSystem& fs) {
  if (!absl::StartsWith(data, kIndexMagic)) {
    fs.Add(std::string(kSingleFilePath), data);
    return std::string(kSingleFilePath);
  }
  data.remove_prefix(kIndexMagic.size());
  for (size_t k = 0;; ++k) {
    const size_t end = data.find(kFileSeparator);
    fs.Add(k == 0 ? std::string(kIndexPath) : ShardPath(k), data.substr(0, end));
    if (end == absl::string_view::npos) break;
    data.remove_prefix(end + kFileSeparator.size());
  }
  return std::string(kIndexPath);
}

// The inverse, for the seed generator: an index and its files as one input.
inline std::string JoinInput(absl::string_view index, const std::vector<std::string>& files) {
  std::string out = absl::StrCat(kIndexMagic, index);
  for (const std::string& file : files) absl::StrAppend(&out, kFileSeparator, file);
  return out;
}

}  // namespace layercast::fuzz
