#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/statusor.h"
#include "client/layer_source.h"

namespace layercast::gpu {

// Lands whole assembled layers in device memory: the seam DeviceLayerStream
// is written against. DeviceGatherer lands a layer from one worker's own
// gather; NcclLayerGatherer has each of K local ranks land 1/K and completes
// the layer with an all-gather.
//
// Not thread-safe: one Land at a time (the stream's background thread).
class DeviceLander {
 public:
  virtual ~DeviceLander() = default;

  // Where layers come from (their specs, layouts and the model).
  virtual const client::LayerSource& source() const = 0;
  // The device layers land on.
  virtual int device() const = 0;
  // The stream every write of a landing is enqueued on; it lives as long as
  // the lander.
  virtual cudaStream_t stream() const = 0;
  // Device bytes a landing of `layer` needs: its assembled bytes, or more
  // (padding). REQUIRES: layer < number of layers.
  virtual uint64_t DeviceBytes(uint32_t layer) const = 0;
  // Lands layer `layer` at `dst` (DeviceBytes(layer) bytes of device memory
  // usable on stream()); returns the parameter version. When it returns, the
  // writes are enqueued on stream(), not necessarily complete: record an
  // event on stream() to know when. The error of the gather (as
  // LayerSource::GatherInto) or of CUDA/NCCL otherwise; work already enqueued
  // may still write to `dst` until stream() passes it.
  virtual absl::StatusOr<uint64_t> Land(uint32_t layer, const client::GatherOptions& options,
                                        void* dst) = 0;
};

}  // namespace layercast::gpu
