#include "client/gpu/device_layer_stream.h"

#include "absl/strings/str_cat.h"
#include "client/gpu/cuda_status.h"
#include "client/prefetch_scheduler.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::gpu {

namespace {

// A stream-ordered free the device may not have reached yet.
class FreeOnDevice final : public client::PendingRelease {
 public:
  explicit FreeOnDevice(CudaEvent freed) : freed_(std::move(freed)) {}
  bool Done() override { return cudaEventQuery(freed_.get()) != cudaErrorNotReady; }
  void Wait() override {
    // The compute that last read the layer, then the free.
    cudaEventSynchronize(freed_.get());
    cudaGetLastError();
  }

 private:
  CudaEvent freed_;
};

// Layers land in device memory from the stream's own pool; a dropped layer's
// bytes come back when its stream-ordered free has completed on the device.
class DeviceLanding final : public client::PrefetchScheduler<DeviceLayer>::Landing {
 public:
  explicit DeviceLanding(DeviceLander& lander) : lander_(lander) {}

  // Separate from construction: checking an order needs no device, the pool does.
  absl::Status CreatePool(uint64_t budget_bytes) {
    ASSIGN_OR_RETURN(memory_, DeviceMemoryPool::Create(lander_.device(), budget_bytes));
    return absl::OkStatus();
  }

  const wire::ShardSetView& view() const override { return lander_.source().view(); }
  client::ClientMetrics* metrics() const override { return lander_.source().metrics(); }
  uint64_t Bytes(uint32_t layer) const override { return lander_.DeviceBytes(layer); }
  std::string Needs(uint32_t layer) const override {
    return absl::StrCat("needs ", FormatBytes(Bytes(layer)), " of device memory");
  }

  absl::StatusOr<DeviceLayer> Land(
      uint32_t layer, uint64_t bytes, const client::GatherOptions& gather,
      client::PrefetchScheduler<DeviceLayer>::Released released) override {
    DeviceGuard guard(lander_.device());
    if (!guard.status().ok()) {
      released(nullptr);
      return guard.status();
    }
    absl::StatusOr<DeviceBuffer> allocated =
        memory_->Allocate(bytes, lander_.stream(), [released](CudaEvent freed) {
          released(freed ? std::make_unique<FreeOnDevice>(std::move(freed)) : nullptr);
        });
    if (!allocated.ok()) {
      released(nullptr);  // nothing was allocated: the bytes come back now
      return allocated.status();
    }
    DeviceBuffer buffer = *std::move(allocated);
    absl::StatusOr<uint64_t> version = lander_.Land(layer, gather, buffer.data());
    // Even after a failure copies may be in flight into the buffer: its free
    // must wait for them.
    RETURN_IF_ERROR(buffer.RecordUse(lander_.stream()));
    RETURN_IF_ERROR(version.status());
    ASSIGN_OR_RETURN(CudaEvent ready, CudaEvent::Create());
    CUDA_RETURN_IF_ERROR(cudaEventRecord(ready.get(), lander_.stream()),
                         "cudaEventRecord (layer ready)");
    const wire::ShardSetView& view = lander_.source().view();
    return DeviceLayer(layer, &view.model.layers[layer], &view.layouts[layer], *version,
                       std::move(buffer), std::move(ready));
  }

  const DeviceMemoryPool& memory() const { return *memory_; }

 private:
  DeviceLander& lander_;
  std::unique_ptr<DeviceMemoryPool> memory_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceLayerStream>> DeviceLayerStream::Create(
    DeviceLander& lander, DeviceLayerStreamOptions options) {
  using Scheduler = client::PrefetchScheduler<DeviceLayer>;
  auto landing = std::make_unique<DeviceLanding>(lander);
  RETURN_IF_ERROR(Scheduler::CheckOrder(*landing, options));
  RETURN_IF_ERROR(landing->CreatePool(options.budget_bytes));
  const DeviceMemoryPool& pool = landing->memory();
  ASSIGN_OR_RETURN(
      std::shared_ptr<client::PrefetchScheduler<DeviceLayer>> scheduler,
      client::PrefetchScheduler<DeviceLayer>::Create(std::move(landing), std::move(options)));
  return std::unique_ptr<DeviceLayerStream>(new DeviceLayerStream(std::move(scheduler), pool));
}

DeviceLayerStream::DeviceLayerStream(
    std::shared_ptr<client::PrefetchScheduler<DeviceLayer>> scheduler,
    const DeviceMemoryPool& memory)
    : scheduler_(std::move(scheduler)), memory_(memory) {}

DeviceLayerStream::~DeviceLayerStream() { scheduler_->Shutdown(); }

absl::StatusOr<DeviceLayer> DeviceLayerStream::Next() { return scheduler_->Next(); }

DeviceLayerStreamStats DeviceLayerStream::stats() const {
  DeviceLayerStreamStats stats;
  static_cast<client::PrefetchStats&>(stats) = scheduler_->stats();
  stats.pool_reserved_high_bytes = memory_.reserved_high_bytes();
  stats.pool_used_high_bytes = memory_.used_high_bytes();
  return stats;
}

}  // namespace layercast::gpu
