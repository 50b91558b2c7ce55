#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/layer.h"
#include "client/layer_source.h"

namespace layercast::client {

struct LayerStreamOptions {
  // The layers the caller will use, in the order it will ask for them; any
  // list, repeats allowed (see ForwardOrder and friends).
  std::vector<uint32_t> order;
  // Host bytes of assembled layers the stream may hold at once: layers
  // fetched ahead plus layers handed out and not yet dropped.
  uint64_t budget_bytes = 0;
  // How many layers may be gathered before the caller asks for them; 0
  // fetches on demand. Unlimited by default: the budget decides.
  uint32_t max_lookahead = UINT32_MAX;
  // Per-gather options (timeout, min_version); `cancellation` is the stream's.
  GatherOptions gather;
};

// 0, 1, ..., n-1.
std::vector<uint32_t> ForwardOrder(uint32_t num_layers);
// n-1, ..., 0.
std::vector<uint32_t> BackwardOrder(uint32_t num_layers);
// Forward, then backward: one training step.
std::vector<uint32_t> ForwardBackwardOrder(uint32_t num_layers);

// Counters a LayerStream keeps; see stats().
struct LayerStreamStats {
  uint64_t layers = 0;      // handed out by Next()
  uint64_t hits = 0;        // Next() found the layer already gathered
  uint64_t misses = 0;      // Next() had to wait for it
  double wait_seconds = 0;  // time callers spent blocked in Next()
  uint64_t peak_bytes = 0;  // most budgeted bytes held at once
  uint64_t budget_bytes = 0;
};

// Hands a caller the layers of a declared order one by one, gathering ahead
// in the background (a Boost.Asio thread) as far as the byte budget and the
// look-ahead allow, never beyond, and strictly in order. A handed-out Layer is
// an RAII handle: dropping it returns its bytes to the budget and lets the
// stream go on. Destroying the stream cancels the gather in flight and waits
// for it; layers already handed out stay valid.
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

  struct State;  // shared with the background work and handed-out layers

 private:
  explicit LayerStream(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace layercast::client
