#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "client/gpu/cuda_handles.h"
#include "client/gpu/device_lander.h"
#include "client/layer_source.h"

namespace layercast::gpu {

struct DeviceGathererOptions {
  // The CUDA device layers land on.
  int device = 0;
  // A landing is gathered in pieces of this many bytes (rounded up to
  // kAssembledAlignment): piece i+1 arrives from the shards while piece i is
  // copied to the device. Each piece is one byte-range gather (a stream per
  // shard), so pieces much smaller than a few MiB cost round trips.
  uint64_t piece_bytes = 16ull << 20;
};

// Lands layers from a LayerSource in device memory through pinned host
// staging. The layer (or a byte range of it) is gathered piece by piece into
// a page-locked buffer (cudaHostAlloc); as each piece arrives it is copied to
// the device with cudaMemcpyAsync on the gatherer's own stream, so the copy of
// one piece overlaps the arrival of the next, and the device holds the layer
// with the host layout.
//
// Staging is one pinned buffer as large as the model's largest layer, because
// LayerSource::GatherInto writes each byte at its assembled offset; its pieces
// are the ring: a piece is overwritten only after the copy that last read
// those bytes has completed (tracked with one event per copy), so landings
// back to back pipeline too.
//
// Not thread-safe: one landing at a time.
class DeviceGatherer final : public DeviceLander {
 public:
  // Allocates the stream and the staging. `source` must outlive the gatherer.
  // FAILED_PRECONDITION without a usable device; RESOURCE_EXHAUSTED when the
  // staging cannot be pinned.
  static absl::StatusOr<std::unique_ptr<DeviceGatherer>> Create(const client::LayerSource& source,
                                                                DeviceGathererOptions options = {});
  ~DeviceGatherer() override;

  const client::LayerSource& source() const override { return source_; }
  int device() const override { return options_.device; }
  cudaStream_t stream() const override { return stream_.get(); }
  uint64_t DeviceBytes(uint32_t layer) const override;
  absl::StatusOr<uint64_t> Land(uint32_t layer, const client::GatherOptions& options,
                                void* dst) override;

  // Lands bytes [begin, end) of layer `layer`'s assembled layout at `dst`
  // (end - begin bytes: dst[0] is assembled byte `begin`). Both ends must be
  // multiples of kAssembledAlignment or the layer's end, and begin < end
  // (INVALID_ARGUMENT otherwise). `options.byte_range` is ignored. Returns
  // the parameter version; ABORTED if the shards' version changed between
  // pieces (retry with min_version set to the newer one, as the message says).
  // 8-bit float codes in the range come without their block scales unless
  // the range also holds the scales (they lie after all the tensor's codes).
  absl::StatusOr<uint64_t> LandRange(uint32_t layer, const client::GatherOptions& options,
                                     uint64_t begin, uint64_t end, void* dst);

  // Host bytes pinned for staging.
  uint64_t staging_bytes() const { return staging_.size(); }

 private:
  // A copy out of staging bytes [begin, end), complete when `done` is.
  struct PendingCopy {
    uint64_t begin;
    uint64_t end;
    CudaEvent done;
  };

  DeviceGatherer(const client::LayerSource& source, DeviceGathererOptions options,
                 CudaStream stream, PinnedBuffer staging)
      : source_(source),
        options_(options),
        stream_(std::move(stream)),
        staging_(std::move(staging)) {}

  // Waits until no copy still in flight reads staging bytes [begin, end).
  absl::Status WaitForStaging(uint64_t begin, uint64_t end);
  // Forgets the copies [0, count) of pending_, which have completed.
  void Retire(size_t count);

  const client::LayerSource& source_;
  const DeviceGathererOptions options_;
  CudaStream stream_;
  PinnedBuffer staging_;
  std::deque<PendingCopy> pending_;  // oldest first, in stream order
  std::vector<CudaEvent> spare_events_;
};

}  // namespace layercast::gpu
