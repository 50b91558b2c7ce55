#include "core/safetensors_source.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "platform/status_macros.h"

namespace layercast {

absl::StatusOr<std::unique_ptr<SafetensorsSource>> SafetensorsSource::Open(
    const std::string& path, std::string model_id, const LayerGroupingRule& rule, FileSystem& fs) {
  auto source = std::unique_ptr<SafetensorsSource>(new SafetensorsSource());
  ASSIGN_OR_RETURN(source->reader_, SafetensorsReader::Open(path, fs));
  if (model_id.empty()) model_id = std::filesystem::path(path).filename().string();
  ASSIGN_OR_RETURN(source->model_,
                   ModelSpecFromSafetensors(*source->reader_, std::move(model_id), rule));
  for (const LayerSpec& layer : source->model_.layers) {
    std::vector<const SafetensorsTensor*>& entries = source->entries_.emplace_back();
    for (const TensorSpec& tensor : layer.tensors) {
      const SafetensorsTensor* entry = source->reader_->Find(tensor.name);
      if (entry == nullptr) {
        return absl::InternalError(absl::StrCat("tensor ", tensor.name, " vanished from ", path));
      }
      entries.push_back(entry);
    }
  }
  return source;
}

std::map<DType, uint64_t> SafetensorsSource::StoredElements() const {
  std::map<DType, uint64_t> elements;
  for (const auto& layer : entries_) {
    for (const SafetensorsTensor* entry : layer) elements[entry->dtype] += entry->num_elements;
  }
  return elements;
}

absl::Status SafetensorsSource::Read(uint32_t layer, uint32_t tensor, ElementRange range,
                                     std::span<float> dst) const {
  return reader_->ReadF32(*entries_[layer][tensor], range, dst);
}

}  // namespace layercast
