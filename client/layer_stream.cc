#include "client/layer_stream.h"

#include "absl/strings/str_cat.h"
#include "client/prefetch_scheduler.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::client {

std::vector<uint32_t> ForwardOrder(uint32_t num_layers) {
  std::vector<uint32_t> order;
  for (uint32_t l = 0; l < num_layers; ++l) order.push_back(l);
  return order;
}

std::vector<uint32_t> BackwardOrder(uint32_t num_layers) {
  std::vector<uint32_t> order = ForwardOrder(num_layers);
  return {order.rbegin(), order.rend()};
}

std::vector<uint32_t> ForwardBackwardOrder(uint32_t num_layers) {
  std::vector<uint32_t> order = ForwardOrder(num_layers);
  std::vector<uint32_t> backward = BackwardOrder(num_layers);
  order.insert(order.end(), backward.begin(), backward.end());
  return order;
}

namespace {

// Layers land in host buffers of their own, whose bytes come back as soon as
// the Layer holding them is dropped.
class HostLanding final : public PrefetchScheduler<Layer>::Landing {
 public:
  explicit HostLanding(const LayerSource& source) : source_(source) {}

  const wire::ShardSetView& view() const override { return source_.view(); }
  ClientMetrics* metrics() const override { return source_.metrics(); }
  uint64_t Bytes(uint32_t layer) const override {
    return source_.view().layouts[layer].total_bytes();
  }
  std::string Needs(uint32_t layer) const override {
    return absl::StrCat("assembles to ", FormatBytes(Bytes(layer)));
  }

  absl::StatusOr<Layer> Land(uint32_t layer, uint64_t bytes, const GatherOptions& gather,
                             PrefetchScheduler<Layer>::Released released) override {
    absl::StatusOr<LayerBuffer> buffer =
        LayerBuffer::Allocate(bytes, [released] { released(nullptr); });
    if (!buffer.ok()) {
      released(nullptr);  // no buffer, so no release hook to return them
      return buffer.status();
    }
    // A failed gather's buffer is freed on return, giving its bytes back.
    ASSIGN_OR_RETURN(
        uint64_t version,
        source_.GatherInto(layer, gather, std::span<uint8_t>(buffer->data(), buffer->size())));
    return source_.MakeLayer(layer, version, *std::move(buffer));
  }

 private:
  const LayerSource& source_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LayerStream>> LayerStream::Create(const LayerSource& set,
                                                                 LayerStreamOptions options) {
  ASSIGN_OR_RETURN(
      std::shared_ptr<PrefetchScheduler<Layer>> scheduler,
      PrefetchScheduler<Layer>::Create(std::make_unique<HostLanding>(set), std::move(options)));
  return std::unique_ptr<LayerStream>(new LayerStream(std::move(scheduler)));
}

LayerStream::LayerStream(std::shared_ptr<PrefetchScheduler<Layer>> scheduler)
    : scheduler_(std::move(scheduler)) {}

LayerStream::~LayerStream() { scheduler_->Shutdown(); }

absl::StatusOr<Layer> LayerStream::Next() { return scheduler_->Next(); }

LayerStreamStats LayerStream::stats() const { return scheduler_->stats(); }

}  // namespace layercast::client
