#pragma once

#include <cstdint>
#include <vector>

#include "client/layer_source.h"

namespace layercast::client {

// How a prefetching stream (LayerStream on the host, gpu::DeviceLayerStream
// on a GPU) walks the model.
struct PrefetchOptions {
  // The layers the caller will use, in the order it will ask for them; any
  // list, repeats allowed (see ForwardOrder and friends).
  std::vector<uint32_t> order;
  // Bytes of landed layers the stream may hold at once, in the memory it
  // lands in (host or device): layers landed ahead plus layers handed out
  // whose memory has not come back yet.
  uint64_t budget_bytes = 0;
  // How many layers may be landed before the caller asks for them; 0 lands
  // on demand. Unlimited by default: the budget decides.
  uint32_t max_lookahead = UINT32_MAX;
  // Per-gather options (timeout, min_version); `cancellation` is the stream's.
  GatherOptions gather;
};

// Counters a prefetching stream keeps.
struct PrefetchStats {
  uint64_t layers = 0;      // handed out by Next()
  uint64_t hits = 0;        // Next() found the layer already landed
  uint64_t misses = 0;      // Next() had to wait for it
  uint64_t landed = 0;      // layers landed so far, handed out or ahead
  double wait_seconds = 0;  // host time callers spent blocked in Next()
  uint64_t peak_bytes = 0;  // most budgeted bytes held at once
  uint64_t budget_bytes = 0;
};

}  // namespace layercast::client
