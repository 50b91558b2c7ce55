#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layer_grouping.h"
#include "core/parameter_source.h"
#include "core/safetensors.h"
#include "platform/file_system.h"

namespace layercast {

// Parameters from a safetensors checkpoint (one file or an index), grouped
// into layers by a LayerGroupingRule. F32, BF16 and F16 tensors are widened
// to fp32 as they are read; Read() touches only the requested elements'
// bytes. Thread-safe.
class SafetensorsSource : public ParameterSource {
 public:
  // `model_id` empty: the file's name. `fs` must outlive the source.
  static absl::StatusOr<std::unique_ptr<SafetensorsSource>> Open(
      const std::string& path, std::string model_id, const LayerGroupingRule& rule = {},
      FileSystem& fs = DefaultFileSystem());

  const ModelSpec& model() const override { return model_; }
  // Elements of the model per dtype they are stored in: those not F32 are
  // widened, exactly, to the fp32 master (which is then larger than the file).
  std::map<DType, uint64_t> StoredElements() const;
  // Tensors of dtypes layercast does not serve, left out of the model.
  const std::vector<SafetensorsSkipped>& Skipped() const { return reader_->skipped(); }
  absl::Status Read(uint32_t layer, uint32_t tensor, ElementRange range,
                    std::span<float> dst) const override;

 private:
  SafetensorsSource() = default;
  std::unique_ptr<SafetensorsReader> reader_;
  ModelSpec model_;
  // Per layer, per tensor: the checkpoint entry behind it.
  std::vector<std::vector<const SafetensorsTensor*>> entries_;
};

}  // namespace layercast
