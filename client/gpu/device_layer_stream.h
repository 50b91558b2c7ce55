#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/gpu/device_lander.h"
#include "client/gpu/device_layer.h"
#include "client/layer_source.h"
#include "client/prefetch_options.h"

namespace layercast::client {
template <typename LayerT>
class PrefetchScheduler;
}  // namespace layercast::client

namespace layercast::gpu {

// `budget_bytes` counts device bytes: layers landed ahead plus layers handed
// out whose memory is not yet free on the device.
using DeviceLayerStreamOptions = client::PrefetchOptions;

struct DeviceLayerStreamStats : client::PrefetchStats {
  // Device memory the stream's pool has mapped at most (cudaMemPool
  // ReservedMemHigh): what the budget costs the device in fact.
  uint64_t pool_reserved_high_bytes = 0;
  // The most the stream's layers held of it at once (UsedMemHigh; a layer
  // stops counting when its free is enqueued): reserved high above this is
  // memory the pool mapped and did not reuse.
  uint64_t pool_used_high_bytes = 0;
};

// The device counterpart of client::LayerStream: hands the caller the layers
// of a declared order one by one, landing ahead on a background thread (a
// Boost.Asio thread) as far as the device byte budget and the look-ahead
// allow, never beyond, strictly in order (the scheduling is
// client::PrefetchScheduler's, shared with client::LayerStream). Device
// memory comes from a pool of the stream's own (allocated on the pool's
// stream, which the lander's stream waits for: DeviceMemoryPool::Allocate).
//
// A handed-out DeviceLayer is an RAII handle: the caller makes its compute
// stream wait with WaitOn (a GPU-side wait), records its use with RecordUse,
// and drops it; the bytes return to the budget when the stream-ordered free
// has completed on the device, so the budget bounds real device memory even
// though the host runs ahead of the GPU. Destroying the stream cancels the
// landing in flight and waits for it; layers handed out stay valid.
//
// Next() is for one caller thread; stats() may be called from any thread.
class DeviceLayerStream {
 public:
  // Refuses an order naming a layer that does not exist (NOT_FOUND), or whose
  // landing needs more than the budget (RESOURCE_EXHAUSTED naming the sizes).
  // `lander` (and its source) must outlive the stream; the source must also
  // outlive every layer handed out.
  static absl::StatusOr<std::unique_ptr<DeviceLayerStream>> Create(
      DeviceLander& lander, DeviceLayerStreamOptions options);
  ~DeviceLayerStream();

  // The next layer of the order (its copies enqueued; wait on its event). OUT_OF_RANGE after the
  // last; the landing's error if it failed; RESOURCE_EXHAUSTED if the next layer can never fit
  // because the caller holds too many layers.
  absl::StatusOr<DeviceLayer> Next();

  DeviceLayerStreamStats stats() const;

 private:
  DeviceLayerStream(std::shared_ptr<client::PrefetchScheduler<DeviceLayer>> scheduler,
                    const DeviceMemoryPool& memory);
  std::shared_ptr<client::PrefetchScheduler<DeviceLayer>> scheduler_;
  const DeviceMemoryPool& memory_;  // owned by the scheduler's landing
};

}  // namespace layercast::gpu
