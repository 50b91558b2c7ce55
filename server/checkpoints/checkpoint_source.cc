#include "server/checkpoints/checkpoint_source.h"

#include "core/content_fingerprint.h"

#include <algorithm>
#include <bit>
#include <charconv>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/crc32c.h"
#include "core/layout.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"

namespace layercast::server {
namespace {

// Floats per read when the data is hashed a second time.
constexpr uint64_t kRehashElements = 1 << 20;

// Optimizer state and staged pushes: what a training checkpoint holds
// beside the master.
bool IsTrainingState(const std::string& name) {
  return name.rfind(kOptimizerStatePrefix, 0) == 0 || name.rfind(kStagedPushPrefix, 0) == 0;
}

constexpr char kWhatToDo[] =
    "; start the shard with the settings the checkpoint was written with, or move the file away "
    "to start from --model/--synthetic";

absl::Status Mismatch(const std::string& path, const std::string& problem) {
  return absl::FailedPreconditionError(
      absl::StrCat("checkpoint ", path, " does not match this shard: ", problem, kWhatToDo));
}

std::string MetadataValue(const std::map<std::string, std::string>& metadata,
                          const std::string& key) {
  const auto it = metadata.find(key);
  return it == metadata.end() ? std::string("(absent)") : it->second;
}

bool ParseDecimal(const std::string& text, uint64_t* value) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *value);
  return !text.empty() && ec == std::errc() && end == text.data() + text.size();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointSource>> CheckpointSource::Open(
    const std::string& path, const ModelSpec& model, uint32_t shard_index, uint32_t num_shards,
    const Policy& policy, std::optional<ContentFingerprint> lineage, FileSystem& fs) {
  auto source = std::unique_ptr<CheckpointSource>(new CheckpointSource());
  source->path_ = path;
  source->lineage_ = lineage;
  source->model_ = model;
  source->shard_index_ = shard_index;
  source->num_shards_ = num_shards;
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path, fs);
  if (!reader.ok()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path,
                                            " cannot be read as a safetensors file (",
                                            reader.status().message(), ")", kWhatToDo));
  }
  source->reader_ = *std::move(reader);
  RETURN_IF_ERROR(source->CheckHeader(policy));
  {
    absl::MutexLock lock(&source->mu_);  // not shared yet; the analysis asks for it
    source->sha_ = std::make_unique<Sha256>();
    if (!source->file_order_.empty()) source->next_offset_ = source->file_order_[0]->data_begin;
  }
  return source;
}

absl::StatusOr<ContentFingerprint> CheckpointSource::Fingerprint() const {
  if (recorded_fingerprint_) return *recorded_fingerprint_;
  if (lineage_) return *lineage_;
  return absl::FailedPreconditionError(
      absl::StrCat("checkpoint ", path_, " records no content fingerprint and none was given"));
}

absl::Status CheckpointSource::CheckHeader(const Policy& policy) {
  const auto& metadata = reader_->metadata();
  const auto field = [&](const char* key) { return MetadataValue(metadata, key); };
  if (field("format") != kCheckpointFormat) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path_, " has format '", field("format"),
                                            "', not '", kCheckpointFormat, "'", kWhatToDo));
  }
  if (field("format_version") != kCheckpointFormatVersion) {
    return Mismatch(path_,
                    absl::StrCat("it has format version ", field("format_version"),
                                 " and this server reads version ", kCheckpointFormatVersion));
  }
  if (field("model_id") != model_.model_id) {
    // Before model ids were file stems, a file's id was its whole name.
    return Mismatch(path_, absl::StrCat("it holds model '", field("model_id"),
                                        "' and this shard serves '", model_.model_id,
                                        "' (if it is the same model under an older id, start "
                                        "with --model-id '",
                                        field("model_id"), "')"));
  }
  if (field("num_shards") != absl::StrCat(num_shards_) ||
      field("shard_index") != absl::StrCat(shard_index_)) {
    return Mismatch(path_,
                    absl::StrCat("it is shard ", field("shard_index"), " of ", field("num_shards"),
                                 " and this is shard ", shard_index_, " of ", num_shards_));
  }
  ASSIGN_OR_RETURN(const auto layout_digest, LayoutDigest(model_, policy));
  const std::string digest = HexString(layout_digest);
  if (field("layout_digest") != digest) {
    return Mismatch(path_, absl::StrCat("its layout digest is ", field("layout_digest"),
                                        " (policy '", field("policy"), "') and this shard's is ",
                                        digest, " (policy '", policy.ToString(), "')"));
  }
  if (metadata.contains("content_fingerprint")) {
    recorded_fingerprint_ = ParseFingerprintHex(field("content_fingerprint"));
    if (!recorded_fingerprint_) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", path_, " records content_fingerprint '",
                       field("content_fingerprint"), "', not 64 hex digits", kWhatToDo));
    }
  }
  checksum_ = field("checksum");
  if (checksum_.size() != 7 + 64 || checksum_.rfind("sha256:", 0) != 0) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path_, " records checksum '", checksum_,
                                            "', not sha256:<64 hex digits>", kWhatToDo));
  }
  if (metadata.contains("block_crc32c")) {
    blocks_ = ParseBlockChecksums(field("block_crc32c"));
    if (!blocks_) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint ", path_, " records block_crc32c that is not <bytes>:<hex...>", kWhatToDo));
    }
  }
  if (!ParseDecimal(field("version"), &version_)) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path_, " records version '",
                                            field("version"), "', not a number", kWhatToDo));
  }

  RETURN_IF_ERROR(ParseTraining());
  size_t expected_tensors = 0;
  entries_.resize(model_.layers.size());
  for (uint32_t l = 0; l < model_.layers.size(); ++l) {
    for (const TensorSpec& tensor : model_.layers[l].tensors) {
      ++expected_tensors;
      const SafetensorsTensor* entry = reader_->Find(tensor.name);
      const uint64_t owned =
          ShardElementRange(tensor.num_elements, shard_index_, num_shards_).size();
      if (entry == nullptr) {
        return Mismatch(path_, absl::StrCat("it has no tensor ", tensor.name));
      }
      if (entry->dtype != DType::kFloat32 || entry->shape.size() != 1 ||
          entry->num_elements != owned) {
        return Mismatch(path_, absl::StrCat("tensor ", tensor.name, " holds ", entry->num_elements,
                                            " elements of ", DTypeName(entry->dtype),
                                            " and this shard owns ", owned, " of F32"));
      }
      entries_[l].push_back(entry);
      file_order_.push_back(entry);
    }
  }
  if (!reader_->skipped().empty()) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", path_, " holds tensor ", reader_->skipped().front().name, " of ",
        reader_->skipped().front().dtype, ", which no layercast checkpoint has", kWhatToDo));
  }
  for (const SafetensorsTensor& entry : reader_->tensors()) {
    if (!IsTrainingState(entry.name)) continue;
    const bool listed =
        entry.name.rfind(kStagedPushPrefix, 0) != 0 ||
        (training_ &&
         std::any_of(training_->staged.begin(), training_->staged.end(), [&](const auto& staged) {
           return StagedPushName(staged.first, staged.second) == entry.name;
         }));
    if (!training_ || !listed || entry.dtype != DType::kFloat32 || entry.shape.size() != 1) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint ", path_, " has training state tensor ", entry.name,
          " that is not 1-D F32 of a training checkpoint, or a staged push it does not list",
          kWhatToDo));
    }
    ++expected_tensors;
    file_order_.push_back(&entry);
  }
  if (reader_->tensors().size() != expected_tensors) {
    return Mismatch(path_, absl::StrCat("it has ", reader_->tensors().size(),
                                        " tensors and the model and its optimizer state have ",
                                        expected_tensors));
  }
  std::stable_sort(file_order_.begin(), file_order_.end(),
                   [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
                     return a->data_begin < b->data_begin;
                   });
  if (blocks_) {
    uint64_t data_bytes = 0;
    for (const SafetensorsTensor* entry : file_order_) data_bytes += entry->num_elements * 4;
    if (!file_order_.empty()) data_begin_ = file_order_[0]->data_begin;
    if (blocks_->crcs.size() != (data_bytes + blocks_->block_bytes - 1) / blocks_->block_bytes) {
      return absl::DataLossError(absl::StrCat("checkpoint ", path_, " records ",
                                              blocks_->crcs.size(), " block checksums for ",
                                              data_bytes, " bytes of data", kWhatToDo));
    }
    absl::MutexLock lock(&mu_);  // not shared yet; the analysis asks for it
    touched_.assign(blocks_->crcs.size(), false);
  }
  return absl::OkStatus();
}

absl::Status CheckpointSource::ParseTraining() {
  const auto& metadata = reader_->metadata();
  if (!metadata.contains("layer_versions")) return absl::OkStatus();
  Training training;
  training.optimizer = MetadataValue(metadata, "optimizer");
  for (const auto& [key, out] : {std::pair{"layer_versions", &training.layer_versions},
                                 std::pair{"optimizer_steps", &training.optimizer_steps}}) {
    for (absl::string_view part : absl::StrSplit(MetadataValue(metadata, key), ',')) {
      uint64_t value = 0;
      if (!ParseDecimal(std::string(part), &value)) {
        return absl::DataLossError(absl::StrCat("checkpoint ", path_, " records ", key, " '",
                                                MetadataValue(metadata, key),
                                                "', not one number per layer", kWhatToDo));
      }
      out->push_back(value);
    }
    if (out->size() != model_.layers.size()) {
      return Mismatch(path_, absl::StrCat("it records ", key, " of ", out->size(),
                                          " layers and the model has ", model_.layers.size()));
    }
  }
  // Absent from checkpoints written before staged pushes were saved.
  const auto staged_entry = metadata.find("staged_pushes");
  const std::string staged = staged_entry == metadata.end() ? "" : staged_entry->second;
  if (const auto workers = metadata.find("data_parallel_workers"); workers != metadata.end()) {
    uint64_t value = 0;
    if (!ParseDecimal(workers->second, &value) || value == 0) {
      return absl::DataLossError(absl::StrCat("checkpoint ", path_,
                                              " records data_parallel_workers '", workers->second,
                                              "', not a positive number", kWhatToDo));
    }
    training.workers = value;
  }
  if (const auto clip = metadata.find("last_clip"); clip != metadata.end()) {
    const std::vector<std::string> fields = absl::StrSplit(clip->second, ',');
    uint64_t step = 0, bits = 0;
    if (fields.size() != 2 || !ParseDecimal(fields[0], &step) || !ParseDecimal(fields[1], &bits) ||
        bits > UINT32_MAX) {
      return absl::DataLossError(absl::StrCat("checkpoint ", path_, " records last_clip '",
                                              clip->second, "', not STEP,SCALE_BITS", kWhatToDo));
    }
    training.last_clip.emplace(step, std::bit_cast<float>(static_cast<uint32_t>(bits)));
  }
  for (absl::string_view part : absl::StrSplit(staged, ',', absl::SkipEmpty())) {
    const std::vector<std::string> fields = absl::StrSplit(part, '/');
    uint64_t layer = 0, worker = 0;
    if (fields.size() != 2 || !ParseDecimal(fields[0], &layer) || layer >= model_.layers.size() ||
        (fields[1] != kStagedMean && !ParseDecimal(fields[1], &worker)) ||
        reader_->Find(StagedPushName(static_cast<uint32_t>(layer), fields[1])) == nullptr) {
      return absl::DataLossError(absl::StrCat("checkpoint ", path_, " records staged push '", part,
                                              "', which it does not hold", kWhatToDo));
    }
    training.staged.emplace_back(static_cast<uint32_t>(layer), fields[1]);
  }
  if (*std::min_element(training.layer_versions.begin(), training.layer_versions.end()) !=
      version_) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", path_, " records version ", version_, " but its lowest layer is at ",
        *std::min_element(training.layer_versions.begin(), training.layer_versions.end()),
        kWhatToDo));
  }
  training_ = std::move(training);
  return absl::OkStatus();
}

absl::Status CheckpointSource::ReadState(const std::string& name,
                                         std::vector<float>& values) const {
  const SafetensorsTensor* entry = reader_->Find(name);
  if (entry == nullptr || !IsTrainingState(name)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path_, " has no tensor ", name));
  }
  values.resize(entry->num_elements);
  RETURN_IF_ERROR(reader_->ReadF32(*entry, ElementRange{0, entry->num_elements}, values));
  Touch(*entry, ElementRange{0, entry->num_elements});
  Hash(*entry, true, values);
  return absl::OkStatus();
}

absl::Status CheckpointSource::ReadStateRange(const std::string& name, ElementRange range,
                                              std::span<float> dst) const {
  const SafetensorsTensor* entry = reader_->Find(name);
  if (entry == nullptr || !IsTrainingState(name)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path_, " has no tensor ", name));
  }
  if (range.end < range.begin || range.end > entry->num_elements) {
    return absl::OutOfRangeError(absl::StrCat("checkpoint ", path_, " holds ", entry->num_elements,
                                              " elements of ", name, ", not [", range.begin, ", ",
                                              range.end, ")"));
  }
  RETURN_IF_ERROR(reader_->ReadF32(*entry, range, dst));
  Touch(*entry, range);
  Hash(*entry, range.size() == entry->num_elements, dst);
  return absl::OkStatus();
}

void CheckpointSource::Hash(const SafetensorsTensor& entry, bool whole,
                            std::span<const float> values) const {
  absl::MutexLock lock(&mu_);
  if (!out_of_order_ && whole && entry.data_begin == next_offset_) {
    sha_->Update(FloatBytes(values));
    next_offset_ += values.size_bytes();
    ++hashed_tensors_;
  } else {
    out_of_order_ = true;
  }
}

absl::Status CheckpointSource::Read(uint32_t layer, uint32_t tensor, ElementRange range,
                                    std::span<float> dst) const {
  const SafetensorsTensor& entry = *entries_[layer][tensor];
  const ElementRange owned = ShardElementRange(model_.layers[layer].tensors[tensor].num_elements,
                                               shard_index_, num_shards_);
  if (range.begin < owned.begin || range.end > owned.end || range.end < range.begin) {
    return absl::OutOfRangeError(absl::StrCat("checkpoint ", path_, " holds elements [",
                                              owned.begin, ", ", owned.end, ") of ", entry.name,
                                              ", not [", range.begin, ", ", range.end, ")"));
  }
  const ElementRange in_file{range.begin - owned.begin, range.end - owned.begin};
  RETURN_IF_ERROR(reader_->ReadF32(entry, in_file, dst));
  Touch(entry, in_file);
  Hash(entry, range == owned, dst);
  return absl::OkStatus();
}

void CheckpointSource::Touch(const SafetensorsTensor& entry, ElementRange range) const {
  if (!blocks_ || range.empty()) return;
  const uint64_t begin = entry.data_begin - data_begin_ + range.begin * sizeof(float);
  const uint64_t end = entry.data_begin - data_begin_ + range.end * sizeof(float);
  absl::MutexLock lock(&mu_);
  for (uint64_t b = begin / blocks_->block_bytes; b <= (end - 1) / blocks_->block_bytes; ++b) {
    touched_[b] = true;
  }
}

absl::Status CheckpointSource::VerifyReadBlocks() {
  if (!blocks_) return VerifyChecksum();
  std::vector<bool> touched;
  {
    absl::MutexLock lock(&mu_);
    touched = touched_;
  }
  std::vector<float> buffer;
  for (uint64_t b = 0; b < touched.size(); ++b) {
    if (!touched[b]) continue;
    const uint64_t begin = b * blocks_->block_bytes;
    const uint64_t end = begin + blocks_->block_bytes;
    uint32_t crc = 0;
    // The block's bytes are the tensors' that lie in it, in file order.
    for (const SafetensorsTensor* entry : file_order_) {
      const uint64_t first = entry->data_begin - data_begin_;
      const uint64_t last = first + entry->num_elements * sizeof(float);
      if (last <= begin || first >= end) continue;
      const ElementRange elements{(std::max(first, begin) - first) / sizeof(float),
                                  (std::min(last, end) - first) / sizeof(float)};
      buffer.resize(elements.size());
      RETURN_IF_ERROR(reader_->ReadF32(*entry, elements, buffer));
      const std::span<const uint8_t> bytes = FloatBytes(buffer);
      crc = Crc32c(bytes.data(), bytes.size(), crc);
    }
    if (crc != blocks_->crcs[b]) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint ", path_, " is corrupt: its data bytes [", begin, ", ", end,
          ") hash to crc32c ", absl::Hex(crc, absl::kZeroPad8), " but its header records ",
          absl::Hex(blocks_->crcs[b], absl::kZeroPad8),
          "; restore it from a copy, or move it away to start from --model/--synthetic"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointSource::VerifyChecksum() {
  std::string actual;
  {
    absl::MutexLock lock(&mu_);
    if (!out_of_order_ && hashed_tensors_ == file_order_.size()) actual = sha_->Finish();
  }
  if (actual.empty()) {
    Sha256 sha;
    std::vector<float> buffer;
    for (const SafetensorsTensor* entry : file_order_) {
      for (uint64_t begin = 0; begin < entry->num_elements; begin += kRehashElements) {
        const uint64_t end = std::min(entry->num_elements, begin + kRehashElements);
        buffer.resize(end - begin);
        RETURN_IF_ERROR(reader_->ReadF32(*entry, ElementRange{begin, end}, buffer));
        sha.Update(FloatBytes(buffer));
      }
    }
    actual = sha.Finish();
  }
  if (actual != checksum_) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", path_, " is corrupt: its data hashes to ", actual,
        " but its header records ", checksum_,
        "; restore it from a copy, or move it away to start from --model/--synthetic"));
  }
  return absl::OkStatus();
}

}  // namespace layercast::server
