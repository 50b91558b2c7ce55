// SafetensorsReader: every header is validated as untrusted input before any
// tensor is exposed. The only allocation sized by the file is the header
// buffer, and its declared length is checked against both the file size and
// kMaxSafetensorsHeaderBytes first.

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "core/safetensors.h"
#include "nlohmann/json.hpp"
#include "platform/status_macros.h"

namespace layercast {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian and is read straight into memory");

using Json = nlohmann::json;

constexpr uint64_t kLengthPrefixBytes = 8;
// 16-bit tensors are widened through a scratch buffer of at most this many
// bytes, so a read of any size costs a bounded amount of extra memory.
constexpr size_t kWidenChunkBytes = 1 << 20;

absl::Status Malformed(const std::string& path, std::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors file '", path, "': ", std::string(problem)));
}

absl::Status Prefixed(const absl::Status& status, std::string_view prefix) {
  return absl::Status(status.code(),
                      absl::StrCat(std::string(prefix), std::string(status.message())));
}

// Parses `text` as a JSON object. nlohmann silently keeps one of two equal
// keys; a duplicated tensor name is refused instead, since which one the
// producer meant is unknowable.
absl::StatusOr<Json> ParseJsonObject(std::string_view text, const std::string& path,
                                     std::string_view what) {
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  auto track_keys = [&](int, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == Json::parse_event_t::object_end) {
      open_objects.pop_back();
    } else if (event == Json::parse_event_t::key && !open_objects.empty()) {
      if (!open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  Json json;
  // nlohmann reports syntax errors only by exception; they stop here.
  try {
    json = Json::parse(text.begin(), text.end(), track_keys);
  } catch (const Json::exception& e) {
    return Malformed(path, absl::StrCat(std::string(what), " is not valid JSON: ", e.what()));
  }
  if (!json.is_object()) {
    return Malformed(
        path, absl::StrCat(std::string(what), " is a JSON ", json.type_name(), ", not an object"));
  }
  if (!duplicate.empty()) {
    return Malformed(path,
                     absl::StrCat(std::string(what), " names '", duplicate, "' more than once"));
  }
  return json;
}

struct ParsedFile {
  std::vector<SafetensorsTensor> tensors;
  std::vector<SafetensorsSkipped> skipped;
  std::map<std::string, std::string> metadata;
};

// A header entry as parsed: the tensor, its bytes in the data section, and,
// for a dtype that is not served, that dtype's name.
struct ParsedTensor {
  SafetensorsTensor tensor;
  uint64_t bytes = 0;
  std::string skipped_dtype;  // empty: served
};

absl::StatusOr<std::map<std::string, std::string>> ParseMetadata(const Json& json,
                                                                 const std::string& path) {
  if (!json.is_object()) {
    return Malformed(path, absl::StrCat("__metadata__ is a JSON ", json.type_name(),
                                        ", not an object of strings"));
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : json.items()) {
    if (!value.is_string()) {
      return Malformed(path, absl::StrCat("__metadata__ entry '", key, "' is a JSON ",
                                          value.type_name(), ", not a string"));
    }
    metadata.emplace(key, value.get<std::string>());
  }
  return metadata;
}

// Validates one tensor entry of a header. `data_bytes` is the size of the byte
// buffer after the header; offsets are relative to it.
absl::StatusOr<ParsedTensor> ParseTensor(const std::string& name, const Json& entry,
                                         uint64_t data_start, uint64_t data_bytes,
                                         uint32_t file_index, const std::string& path) {
  const std::string where = absl::StrCat("tensor '", name, "'");
  if (!entry.is_object()) {
    return Malformed(path, absl::StrCat(where, " is a JSON ", entry.type_name(),
                                        ", not an object with dtype, shape and data_offsets"));
  }
  SafetensorsTensor tensor;
  tensor.name = name;
  tensor.file = file_index;

  const auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) {
    return Malformed(path, absl::StrCat(where, ": \"dtype\" must be a string such as \"F32\""));
  }
  const std::string dtype_name = dtype->get<std::string>();
  absl::StatusOr<DType> parsed_dtype = DTypeFromSafetensorsName(dtype_name);
  // Integer and boolean tensors are checked, then skipped (position ids,
  // masks: no parameter). Floating-point dtypes a shard cannot serve (F64,
  // FP8 weights, whose model would lose its linear layers) are refused.
  const std::optional<IntegerDType> skipped_dtype = IntegerDTypeFromSafetensorsName(dtype_name);
  if (!parsed_dtype.ok() && !skipped_dtype) {
    return Malformed(path, absl::StrCat(where, ": dtype '", dtype_name,
                                        "' is not supported: layercast serves F32, BF16 and F16 "
                                        "tensors and skips integer and boolean ones"));
  }
  if (parsed_dtype.ok()) tensor.dtype = *parsed_dtype;
  const uint64_t element_size =
      parsed_dtype.ok() ? DTypeSize(*parsed_dtype) : IntegerDTypeSize(*skipped_dtype);

  const auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) {
    return Malformed(path, absl::StrCat(where, ": \"shape\" must be an array of integers"));
  }
  uint64_t num_elements = 1;
  for (const Json& dim : *shape) {
    if (dim.is_number_integer() && !dim.is_number_unsigned()) {  // only negatives parse signed
      return Malformed(
          path, absl::StrCat(where, ": shape dimension ", dim.get<int64_t>(), " is negative"));
    }
    if (!dim.is_number_unsigned()) {
      return Malformed(path, absl::StrCat(where, ": shape dimension ", dim.dump(),
                                          " is not a non-negative integer"));
    }
    const uint64_t value = dim.get<uint64_t>();
    if (value > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_mul_overflow(num_elements, value, &num_elements)) {
      return Malformed(path, absl::StrCat(where, ": shape ", shape->dump(),
                                          " has more elements than fit in 64 bits"));
    }
    tensor.shape.push_back(static_cast<int64_t>(value));
  }
  tensor.num_elements = num_elements;
  uint64_t num_bytes = 0;
  if (__builtin_mul_overflow(num_elements, element_size, &num_bytes)) {
    return Malformed(path, absl::StrCat(where, ": shape ", shape->dump(), " of ", dtype_name,
                                        " has more bytes than fit in 64 bits"));
  }

  const auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
    return Malformed(path, absl::StrCat(where,
                                        ": \"data_offsets\" must be [begin, end], two "
                                        "non-negative integers"));
  }
  const uint64_t begin = (*offsets)[0].get<uint64_t>();
  const uint64_t end = (*offsets)[1].get<uint64_t>();
  if (begin > end) {
    return Malformed(
        path, absl::StrCat(where, ": data_offsets [", begin, ", ", end, "] begin after they end"));
  }
  if (end > data_bytes) {
    return Malformed(
        path, absl::StrCat(where, ": data_offsets [", begin, ", ", end, "] reach beyond the ",
                           data_bytes, " data bytes after the header"));
  }
  if (end - begin != num_bytes) {
    return Malformed(path, absl::StrCat(where, ": shape ", shape->dump(), " of ", dtype_name,
                                        " needs ", num_bytes, " bytes but data_offsets [", begin,
                                        ", ", end, "] span ", end - begin));
  }
  tensor.data_begin = data_start + begin;
  return ParsedTensor{std::move(tensor), num_bytes, parsed_dtype.ok() ? "" : dtype_name};
}

// Two tensors claiming the same bytes mean a corrupt or hostile header; the
// reference implementation refuses them too. Empty tensors claim no bytes.
absl::Status CheckNoOverlap(const std::vector<ParsedTensor>& tensors, const std::string& path) {
  struct Span {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (const ParsedTensor& parsed : tensors) {
    const SafetensorsTensor& tensor = parsed.tensor;
    if (parsed.bytes > 0) {
      spans.push_back({tensor.data_begin, tensor.data_begin + parsed.bytes, &tensor.name});
    }
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end) {
      return Malformed(path, absl::StrCat("tensors '", *spans[i - 1].name, "' and '",
                                          *spans[i].name, "' overlap in the data section"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ParsedFile> ParseFile(const RandomAccessFile& file, uint32_t file_index) {
  const std::string& path = file.path();
  if (file.size() < kLengthPrefixBytes) {
    return Malformed(path, absl::StrCat("is ", file.size(),
                                        " bytes long, shorter than the 8-byte header length"));
  }
  uint8_t prefix[kLengthPrefixBytes];
  RETURN_IF_ERROR(file.ReadAt(0, prefix));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | prefix[i];
  if (header_bytes > kMaxSafetensorsHeaderBytes) {
    return Malformed(path,
                     absl::StrCat("declares a ", header_bytes, "-byte header, above the limit of ",
                                  kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_bytes > file.size() - kLengthPrefixBytes) {
    return Malformed(path,
                     absl::StrCat("declares a ", header_bytes, "-byte header but only ",
                                  file.size() - kLengthPrefixBytes, " bytes follow the length"));
  }
  std::string header(header_bytes, '\0');
  RETURN_IF_ERROR(
      file.ReadAt(kLengthPrefixBytes,
                  std::span<uint8_t>(reinterpret_cast<uint8_t*>(header.data()), header.size())));
  ASSIGN_OR_RETURN(Json json, ParseJsonObject(header, path, "the header"));

  const uint64_t data_start = kLengthPrefixBytes + header_bytes;
  const uint64_t data_bytes = file.size() - data_start;
  ParsedFile parsed;
  std::vector<ParsedTensor> entries;
  for (const auto& [name, entry] : json.items()) {
    if (name == "__metadata__") {
      ASSIGN_OR_RETURN(parsed.metadata, ParseMetadata(entry, path));
      continue;
    }
    ASSIGN_OR_RETURN(ParsedTensor tensor,
                     ParseTensor(name, entry, data_start, data_bytes, file_index, path));
    entries.push_back(std::move(tensor));
  }
  // Skipped tensors too: their bytes still may not overlap anyone's.
  RETURN_IF_ERROR(CheckNoOverlap(entries, path));
  for (ParsedTensor& entry : entries) {
    if (entry.skipped_dtype.empty()) {
      parsed.tensors.push_back(std::move(entry.tensor));
    } else {
      parsed.skipped.push_back(SafetensorsSkipped{
          std::move(entry.tensor.name), std::move(entry.skipped_dtype),
          std::move(entry.tensor.shape), entry.tensor.file, entry.tensor.data_begin, entry.bytes});
    }
  }
  return parsed;
}

bool EndsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// An index may only name files beside it (or below it): a shard path that
// escapes the checkpoint directory is refused rather than followed.
absl::Status CheckShardName(const std::string& shard, const std::string& index_path) {
  bool escapes = shard.empty() || shard.front() == '/';
  size_t start = 0;
  while (!escapes && start <= shard.size()) {
    const size_t slash = std::min(shard.find('/', start), shard.size());
    escapes = shard.compare(start, slash - start, "..") == 0;
    start = slash + 1;
  }
  if (escapes) {
    return Malformed(index_path, absl::StrCat("weight_map names file '", shard,
                                              "', which is not a path relative to the index's "
                                              "directory"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<SafetensorsReader>> SafetensorsReader::Open(const std::string& path,
                                                                           FileSystem& fs) {
  std::unique_ptr<SafetensorsReader> reader(new SafetensorsReader());
  if (!EndsWith(path, ".index.json")) {
    ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, fs.OpenForRead(path));
    ASSIGN_OR_RETURN(ParsedFile parsed, ParseFile(*file, 0));
    reader->tensors_ = std::move(parsed.tensors);
    reader->skipped_ = std::move(parsed.skipped);
    reader->metadata_ = std::move(parsed.metadata);
    reader->file_paths_.push_back(path);
    reader->files_.push_back(std::move(file));
  } else {
    ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> index, fs.OpenForRead(path));
    if (index->size() > kMaxSafetensorsHeaderBytes) {
      return Malformed(path, absl::StrCat("index is ", index->size(), " bytes, above the limit of ",
                                          kMaxSafetensorsHeaderBytes, " bytes"));
    }
    std::string text(index->size(), '\0');
    RETURN_IF_ERROR(
        index->ReadAt(0, std::span<uint8_t>(reinterpret_cast<uint8_t*>(text.data()), text.size())));
    ASSIGN_OR_RETURN(Json json, ParseJsonObject(text, path, "the index"));
    // "metadata" (e.g. {"total_size": ...}) is informational; only its type is
    // checked.
    if (const auto metadata = json.find("metadata");
        metadata != json.end() && !metadata->is_object()) {
      return Malformed(path, "\"metadata\" must be an object");
    }
    const auto weight_map = json.find("weight_map");
    if (weight_map == json.end() || !weight_map->is_object()) {
      return Malformed(path, "the index has no \"weight_map\" object of tensor name to file name");
    }
    std::map<std::string, std::string> tensor_to_shard;
    std::map<std::string, uint32_t> shard_to_index;  // sorted: shard files in name order
    for (const auto& [tensor, shard] : weight_map->items()) {
      if (!shard.is_string()) {
        return Malformed(path, absl::StrCat("weight_map entry '", tensor, "' is a JSON ",
                                            shard.type_name(), ", not a file name"));
      }
      RETURN_IF_ERROR(CheckShardName(shard.get<std::string>(), path));
      tensor_to_shard.emplace(tensor, shard.get<std::string>());
      shard_to_index.emplace(shard.get<std::string>(), 0);
    }
    if (shard_to_index.size() > UINT32_MAX)
      return Malformed(path, "the index names too many files");
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
    std::map<std::string, uint32_t> seen;  // tensor name -> file index
    for (auto& [shard, file_index] : shard_to_index) {
      file_index = static_cast<uint32_t>(reader->files_.size());
      const std::string shard_path = dir + shard;
      ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, fs.OpenForRead(shard_path));
      ASSIGN_OR_RETURN(ParsedFile parsed, ParseFile(*file, file_index));
      for (SafetensorsTensor& tensor : parsed.tensors) {
        if (auto [it, inserted] = seen.emplace(tensor.name, file_index); !inserted) {
          return Malformed(
              path, absl::StrCat("tensor '", tensor.name, "' is in both '",
                                 reader->file_paths_[it->second], "' and '", shard_path, "'"));
        }
        reader->tensors_.push_back(std::move(tensor));
      }
      for (SafetensorsSkipped& skipped : parsed.skipped) {  // placed by the index all the same
        if (auto [it, inserted] = seen.emplace(skipped.name, file_index); !inserted) {
          return Malformed(
              path, absl::StrCat("tensor '", skipped.name, "' is in both '",
                                 reader->file_paths_[it->second], "' and '", shard_path, "'"));
        }
        reader->skipped_.push_back(std::move(skipped));
      }
      if (file_index == 0) reader->metadata_ = std::move(parsed.metadata);
      reader->file_paths_.push_back(shard_path);
      reader->files_.push_back(std::move(file));
    }
    // The index and the files must agree both ways: a tensor the index does
    // not place, or places elsewhere, means shards from different checkpoints.
    for (const auto& [tensor, shard] : tensor_to_shard) {
      const auto found = seen.find(tensor);
      if (found == seen.end() || found->second != shard_to_index.at(shard)) {
        return Malformed(path, absl::StrCat("weight_map puts tensor '", tensor, "' in '",
                                            dir + shard, "', which has no such tensor"));
      }
    }
    for (const auto& [tensor, file_index] : seen) {
      if (!tensor_to_shard.contains(tensor)) {
        return Malformed(path,
                         absl::StrCat("file '", reader->file_paths_[file_index], "' holds tensor '",
                                      tensor, "', which the weight_map does not list"));
      }
    }
  }
  std::sort(reader->tensors_.begin(), reader->tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) { return a.name < b.name; });
  std::sort(
      reader->skipped_.begin(), reader->skipped_.end(),
      [](const SafetensorsSkipped& a, const SafetensorsSkipped& b) { return a.name < b.name; });
  return reader;
}

const SafetensorsTensor* SafetensorsReader::Find(const std::string& name) const {
  const auto it = std::lower_bound(
      tensors_.begin(), tensors_.end(), name,
      [](const SafetensorsTensor& tensor, const std::string& key) { return tensor.name < key; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

absl::Status SafetensorsReader::ReadF32(const SafetensorsTensor& tensor, ElementRange range,
                                        std::span<float> dst) const {
  if (range.begin > range.end || range.end > tensor.num_elements) {
    return absl::OutOfRangeError(absl::StrCat("elements [", range.begin, ", ", range.end,
                                              ") are outside tensor '", tensor.name, "' of ",
                                              tensor.num_elements, " elements"));
  }
  if (dst.size() != range.size()) {
    return absl::InvalidArgumentError(absl::StrCat("reading ", range.size(),
                                                   " elements of tensor '", tensor.name,
                                                   "' into a buffer of ", dst.size()));
  }
  if (tensor.file >= files_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", tensor.name, "' names file ",
                                                   tensor.file, " but this reader has ",
                                                   files_.size()));
  }
  if (range.empty()) return absl::OkStatus();
  const RandomAccessFile& file = *files_[tensor.file];
  const size_t element_bytes = DTypeSize(tensor.dtype);
  const uint64_t offset = tensor.data_begin + range.begin * element_bytes;
  const std::string context = absl::StrCat("reading tensor '", tensor.name, "': ");

  if (tensor.dtype == DType::kFloat32) {
    absl::Status status = file.ReadAt(
        offset, std::span<uint8_t>(reinterpret_cast<uint8_t*>(dst.data()), dst.size_bytes()));
    return status.ok() ? status : Prefixed(status, context);
  }
  const size_t chunk_elements = kWidenChunkBytes / element_bytes;
  std::vector<uint8_t> scratch(std::min<uint64_t>(range.size(), chunk_elements) * element_bytes);
  for (size_t done = 0; done < dst.size();) {
    const size_t count = std::min(dst.size() - done, chunk_elements);
    const std::span<uint8_t> bytes(scratch.data(), count * element_bytes);
    if (absl::Status status = file.ReadAt(offset + done * element_bytes, bytes); !status.ok()) {
      return Prefixed(status, context);
    }
    CastToF32(bytes.data(), tensor.dtype, dst.data() + done, count);
    done += count;
  }
  return absl::OkStatus();
}

}  // namespace layercast
