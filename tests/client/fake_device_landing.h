#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/layer_source.h"
#include "client/prefetch_scheduler.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::client {

// Device memory as gpu::DeviceLayerStream sees it, without a GPU: a free is
// stream-ordered, so the memory comes back only `free_delay` after the layer
// is dropped (when "the device" reaches the free), not when the host drops
// it. Counts what is allocated and not yet freed, and the most at once.
class FakeDevice {
 public:
  explicit FakeDevice(std::chrono::milliseconds free_delay) : free_delay_(free_delay) {}

  void Allocate(uint64_t bytes) {
    absl::MutexLock lock(&mu_);
    RetireLocked();
    in_use_ += bytes;
    peak_ = std::max(peak_, in_use_);
  }

  // The free of `bytes`, enqueued now; complete `free_delay` later.
  std::unique_ptr<PendingRelease> Free(uint64_t bytes) {
    absl::MutexLock lock(&mu_);
    const auto at = std::chrono::steady_clock::now() + free_delay_;
    frees_.push_back({at, bytes});
    return std::make_unique<Completion>(at);
  }

  uint64_t peak_bytes() const {
    absl::MutexLock lock(&mu_);
    return peak_;
  }

 private:
  // Like a CUDA event recorded after the free.
  class Completion final : public PendingRelease {
   public:
    explicit Completion(std::chrono::steady_clock::time_point at) : at_(at) {}
    bool Done() override { return std::chrono::steady_clock::now() >= at_; }
    void Wait() override { std::this_thread::sleep_until(at_); }

   private:
    std::chrono::steady_clock::time_point at_;
  };

  void RetireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto now = std::chrono::steady_clock::now();
    while (!frees_.empty() && frees_.front().first <= now) {
      in_use_ -= frees_.front().second;
      frees_.pop_front();
    }
  }

  const std::chrono::milliseconds free_delay_;
  mutable absl::Mutex mu_;
  std::deque<std::pair<std::chrono::steady_clock::time_point, uint64_t>> frees_
      ABSL_GUARDED_BY(mu_);
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
};

// A landed layer in fake device memory: an RAII handle like gpu::DeviceLayer,
// whose destruction enqueues the free. Move-only.
class FakeDeviceLayer {
 public:
  FakeDeviceLayer(uint32_t index, std::vector<uint8_t> bytes, std::function<void()> on_drop)
      : index_(index), bytes_(std::move(bytes)), on_drop_(std::move(on_drop)) {}
  FakeDeviceLayer(FakeDeviceLayer&& other) noexcept
      : index_(other.index_),
        bytes_(std::move(other.bytes_)),
        on_drop_(std::exchange(other.on_drop_, nullptr)) {}
  FakeDeviceLayer& operator=(FakeDeviceLayer&& other) noexcept {
    if (this != &other) {
      Drop();
      index_ = other.index_;
      bytes_ = std::move(other.bytes_);
      on_drop_ = std::exchange(other.on_drop_, nullptr);
    }
    return *this;
  }
  ~FakeDeviceLayer() { Drop(); }

  uint32_t index() const { return index_; }
  std::span<const uint8_t> bytes() const { return bytes_; }

 private:
  void Drop() {
    if (on_drop_) std::exchange(on_drop_, nullptr)();
  }
  uint32_t index_;
  std::vector<uint8_t> bytes_;
  std::function<void()> on_drop_;
};

// The device landing's contract (gpu::DeviceLayerStream's DeviceLanding)
// over a FakeDevice: memory is taken before the gather and given back
// through a pending free, also when the gather fails.
class FakeDeviceLanding final : public PrefetchScheduler<FakeDeviceLayer>::Landing {
 public:
  FakeDeviceLanding(const LayerSource& source, std::shared_ptr<FakeDevice> device)
      : source_(source), device_(std::move(device)) {}

  const wire::ShardSetView& view() const override { return source_.view(); }
  ClientMetrics* metrics() const override { return nullptr; }
  uint64_t Bytes(uint32_t layer) const override {
    return source_.view().layouts[layer].total_bytes();
  }
  std::string Needs(uint32_t layer) const override {
    return absl::StrCat("needs ", FormatBytes(Bytes(layer)), " of device memory");
  }

  absl::StatusOr<FakeDeviceLayer> Land(
      uint32_t layer, uint64_t bytes, const GatherOptions& gather,
      PrefetchScheduler<FakeDeviceLayer>::Released released) override {
    device_->Allocate(bytes);
    std::vector<uint8_t> memory(bytes);
    if (absl::Status gathered = source_.GatherInto(layer, gather, memory).status();
        !gathered.ok()) {
      released(device_->Free(bytes));  // copies may be in flight: freed after the device
      return gathered;
    }
    // The drop may come after the stream is gone: the device must outlive it.
    return FakeDeviceLayer(layer, std::move(memory),
                           [device = device_, released, bytes] { released(device->Free(bytes)); });
  }

 private:
  const LayerSource& source_;
  const std::shared_ptr<FakeDevice> device_;
};

// What gpu::DeviceLayerStream is, over the fake device.
class FakeDeviceStream {
 public:
  static absl::StatusOr<std::unique_ptr<FakeDeviceStream>> Create(
      const LayerSource& source, PrefetchOptions options, std::chrono::milliseconds free_delay) {
    auto stream = std::unique_ptr<FakeDeviceStream>(
        new FakeDeviceStream(std::make_shared<FakeDevice>(free_delay)));
    ASSIGN_OR_RETURN(
        stream->scheduler_,
        PrefetchScheduler<FakeDeviceLayer>::Create(
            std::make_unique<FakeDeviceLanding>(source, stream->device_), std::move(options)));
    return stream;
  }
  ~FakeDeviceStream() {
    if (scheduler_ != nullptr) scheduler_->Shutdown();
  }

  absl::StatusOr<FakeDeviceLayer> Next() { return scheduler_->Next(); }
  PrefetchStats stats() const { return scheduler_->stats(); }
  const FakeDevice& device() const { return *device_; }

 private:
  explicit FakeDeviceStream(std::shared_ptr<FakeDevice> device) : device_(std::move(device)) {}
  std::shared_ptr<FakeDevice> device_;
  std::shared_ptr<PrefetchScheduler<FakeDeviceLayer>> scheduler_;
};

}  // namespace layercast::client
