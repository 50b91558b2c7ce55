#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/gpu/device_lander.h"
#include "client/gpu/device_layer.h"
#include "client/layer_source.h"

namespace layercast::gpu {

struct DeviceLayerStreamOptions {
  // The layers the caller will use, in order (client::ForwardOrder and
  // friends build the usual ones); repeats allowed.
  std::vector<uint32_t> order;
  // Device bytes of layers the stream may hold at once: layers landed ahead
  // plus layers handed out whose memory is not yet free on the device.
  uint64_t budget_bytes = 0;
  // How many layers may be landed before the caller asks for them; 0 lands
  // on demand. Unlimited by default: the budget decides.
  uint32_t max_lookahead = UINT32_MAX;
  // Per-landing options (timeout, min_version); `cancellation` is the
  // stream's own.
  client::GatherOptions gather;
};

struct DeviceLayerStreamStats {
  uint64_t layers = 0;      // handed out by Next()
  uint64_t hits = 0;        // Next() found the layer already landed (enqueued)
  uint64_t misses = 0;      // Next() had to wait for it
  double wait_seconds = 0;  // host time callers spent blocked in Next()
  uint64_t peak_bytes = 0;  // most budgeted device bytes held at once
  uint64_t budget_bytes = 0;
  // Device memory the stream's pool has mapped at most (cudaMemPool
  // ReservedMemHigh): what the budget costs the device in fact.
  uint64_t pool_reserved_high_bytes = 0;
};

// The device counterpart of client::LayerStream: hands the caller the layers
// of a declared order one by one, landing ahead on a background thread (a
// Boost.Asio thread) as far as the device byte budget and the look-ahead
// allow, never beyond, strictly in order. Device memory comes from a pool of
// the stream's own (cudaMallocFromPoolAsync on the lander's stream).
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

  struct State;  // shared with the background work and handed-out layers

 private:
  explicit DeviceLayerStream(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace layercast::gpu
