#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/layer.h"
#include "client/layer_source.h"
#include "client/prefetch_options.h"

namespace layercast::client {

template <typename LayerT>
class PrefetchScheduler;

// Options and counters of a LayerStream: see PrefetchOptions, PrefetchStats.
using LayerStreamOptions = PrefetchOptions;
using LayerStreamStats = PrefetchStats;

// 0, 1, ..., n-1.
std::vector<uint32_t> ForwardOrder(uint32_t num_layers);
// n-1, ..., 0.
std::vector<uint32_t> BackwardOrder(uint32_t num_layers);
// Forward, then backward: one training step.
std::vector<uint32_t> ForwardBackwardOrder(uint32_t num_layers);

// Hands a caller the layers of a declared order one by one, gathering ahead
// into host memory in the background (a Boost.Asio thread) as far as the
// byte budget and the look-ahead allow, never beyond, and strictly in order
// (the scheduling is PrefetchScheduler's, shared with gpu::DeviceLayerStream). A handed-out Layer
// is an RAII handle: dropping it returns its bytes to the budget and lets the stream go on.
// Destroying the stream cancels the gather in flight and waits for it; layers already handed out
// stay valid.
//
// Next() is for one caller thread; stats() may be called from any thread.
class LayerStream {
 public:
  // Refuses an order naming a layer that does not exist, or whose assembled
  // size exceeds the budget (RESOURCE_EXHAUSTED naming it and the sizes).
  // `set` (a ShardSet, usually) must outlive the stream and every layer it
  // hands out.
  static absl::StatusOr<std::unique_ptr<LayerStream>> Create(const LayerSource& set,
                                                             LayerStreamOptions options);
  ~LayerStream();

  // The next layer of the order, waiting for it if needed. OUT_OF_RANGE after
  // the last; the gather's error if it failed; RESOURCE_EXHAUSTED if the next
  // layer can never fit because the caller holds too many layers.
  absl::StatusOr<Layer> Next();

  LayerStreamStats stats() const;

 private:
  explicit LayerStream(std::shared_ptr<PrefetchScheduler<Layer>> scheduler);
  std::shared_ptr<PrefetchScheduler<Layer>> scheduler_;
};

}  // namespace layercast::client
