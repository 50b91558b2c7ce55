#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "client/layer_source.h"
#include "core/cast.h"
#include "core/synthetic_model.h"
#include "platform/status_macros.h"

namespace layercast::client {

// A LayerSource that casts a synthetic model in process, with a fixed delay
// per gather: LayerStream's logic exercised without gRPC, so these tests can
// run under ThreadSanitizer (Debian's gRPC is not instrumented).
class InMemoryLayerSource final : public LayerSource {
 public:
  InMemoryLayerSource(const std::string& spec, std::chrono::milliseconds delay)
      : model_(*SyntheticModel::Create(spec)), delay_(delay) {
    view_.model = model_->model();
    view_.policy = *Policy::Parse("c=bf16;*norm*=f32");
    view_.num_shards = 1;
    for (const LayerSpec& layer : view_.model.layers) {
      view_.layouts.push_back(*AssembledLayout::Build(layer, view_.policy));
      view_.gradient_layouts.push_back(*GradientLayout(view_.layouts.back()));
    }
  }

  const wire::ShardSetView& view() const override { return view_; }
  ClientMetrics* metrics() const override { return nullptr; }

  absl::StatusOr<uint64_t> GatherInto(uint32_t layer, const GatherOptions& options,
                                      std::span<uint8_t> buffer) const override {
    ++gathers_;
    const auto until = std::chrono::steady_clock::now() + delay_;
    while (std::chrono::steady_clock::now() < until) {
      if (options.cancellation != nullptr && options.cancellation->cancelled()) {
        return absl::CancelledError("gather cancelled");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const AssembledLayout& layout = view_.layouts[layer];
    for (uint32_t t = 0; t < layout.tensors().size(); ++t) {
      const AssembledTensor& placed = layout.tensors()[t];
      std::vector<float> master(placed.num_elements);
      RETURN_IF_ERROR(model_->Read(layer, t, ElementRange{0, placed.num_elements}, master));
      RETURN_IF_ERROR(CastFromF32(master.data(), buffer.data() + placed.byte_offset, master.size(),
                                  placed.compute_dtype, Fp16Overflow::kError));
    }
    return 0;
  }

  int gathers() const { return gathers_.load(); }

 private:
  std::unique_ptr<SyntheticModel> model_;
  std::chrono::milliseconds delay_;
  wire::ShardSetView view_;
  mutable std::atomic<int> gathers_{0};
};

}  // namespace layercast::client
